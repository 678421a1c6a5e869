// GuardedAllocator: StoragelessAllocator's carving, with the used span of the reservation
// made accessible only while a window is open.
#include "tensor/guarded_allocator.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "core/check.h"

namespace foldpar {
namespace {
constexpr size_t kPage = 4096;
size_t round_up_page(size_t n) { return (n + kPage - 1) / kPage * kPage; }
}  // namespace

GuardedAllocator::GuardedAllocator(size_t reserve_bytes)
    : range_(reserve_bytes, "guarded tensor memory outside a Backend op (the device-memory stand-in)") {}

GuardedAllocator::~GuardedAllocator() = default;

void GuardedAllocator::protect_locked(bool accessible) {
  if (high_water_ == 0) return;
  const int prot = accessible ? PROT_READ | PROT_WRITE : PROT_NONE;
  FP_CHECK(mprotect(range_.base(), high_water_, prot) == 0, "mprotect of {} guarded bytes: {}", high_water_,
           std::strerror(errno));
}

void* GuardedAllocator::allocate(size_t bytes) {
  void* p = range_.allocate(bytes);
  if (p == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  const size_t end = round_up_page(static_cast<size_t>(static_cast<char*>(p) - static_cast<char*>(range_.base())) +
                                   std::max<size_t>(bytes, 1));
  if (end > high_water_) {
    // The new span starts as the reservation does (PROT_NONE); an open window covers it too.
    if (depth_ > 0) {
      FP_CHECK(mprotect(static_cast<char*>(range_.base()) + high_water_, end - high_water_, PROT_READ | PROT_WRITE) == 0,
               "mprotect of {} guarded bytes: {}", end - high_water_, std::strerror(errno));
    }
    high_water_ = end;
  }
  return p;
}

void GuardedAllocator::release(void* ptr, size_t bytes) { range_.release(ptr, bytes); }

void GuardedAllocator::fill_zero(void* ptr, size_t bytes) {
  GuardOpen window(this);
  std::memset(ptr, 0, bytes);
}

void GuardedAllocator::copy_in(void* block, const void* host, size_t bytes) {
  GuardOpen window(this);
  std::memcpy(block, host, bytes);
}

void GuardedAllocator::copy_out(void* host, const void* block, size_t bytes) {
  GuardOpen window(this);
  std::memcpy(host, block, bytes);
}

void GuardedAllocator::copy_within(void* dst, const void* src, size_t bytes) {
  GuardOpen window(this);
  std::memmove(dst, src, bytes);
}

void GuardedAllocator::open() {
  std::lock_guard<std::mutex> lock(mu_);
  if (depth_++ == 0) {
    ++windows_;
    protect_locked(true);
  }
}

void GuardedAllocator::close() {
  std::lock_guard<std::mutex> lock(mu_);
  FP_CHECK(depth_ > 0, "GuardedAllocator::close without an open window");
  if (--depth_ == 0) protect_locked(false);
}

bool GuardedAllocator::is_open() const {
  std::lock_guard<std::mutex> lock(mu_);
  return depth_ > 0;
}

int64_t GuardedAllocator::windows_opened() const {
  std::lock_guard<std::mutex> lock(mu_);
  return windows_;
}

}  // namespace foldpar
