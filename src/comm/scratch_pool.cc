#include "comm/scratch_pool.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <utility>

namespace foldpar {

namespace {

constexpr size_t kLargeGranule = size_t{2} << 20;  // large buffers' sizes round up to this

struct Pool {
  std::mutex mu;
  std::multimap<size_t, std::byte*> free;  // capacity -> buffer
  size_t kept = 0;
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: buffers may return during exit
  return *p;
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Not advised as transparent huge pages: they make the first touch cheaper here but every
// step after it slower (docs/PERFORMANCE.md, "Huge pages: faster first touch, slower steps").
std::byte* allocate(size_t capacity) {
  void* p = std::aligned_alloc(64, capacity);
  if (p == nullptr) throw std::bad_alloc();
  return static_cast<std::byte*>(p);
}

}  // namespace

ScratchBuffer ScratchBuffer::take(size_t bytes) {
  if (bytes == 0) return {};
  const size_t capacity = round_up(bytes, bytes >= kLargeGranule ? kLargeGranule : 64);
  Pool& p = pool();
  {
    std::lock_guard lock(p.mu);
    // The smallest kept buffer that fits, unless it is more than twice what is asked.
    if (auto it = p.free.lower_bound(capacity); it != p.free.end() && it->first <= 2 * capacity) {
      ScratchBuffer b(it->second, it->first);
      p.kept -= it->first;
      p.free.erase(it);
      return b;
    }
  }
  return ScratchBuffer(allocate(capacity), capacity);
}

ScratchBuffer::~ScratchBuffer() {
  if (data_ == nullptr) return;
  Pool& p = pool();
  std::lock_guard lock(p.mu);
  p.free.emplace(capacity_, data_);
  p.kept += capacity_;
  while (p.kept > kMaxKeptBytes) {
    auto largest = std::prev(p.free.end());
    p.kept -= largest->first;
    std::free(largest->second);
    p.free.erase(largest);
  }
}

ScratchBuffer::ScratchBuffer(ScratchBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), capacity_(std::exchange(other.capacity_, 0)) {}

ScratchBuffer& ScratchBuffer::operator=(ScratchBuffer&& other) noexcept {
  if (this != &other) {
    ScratchBuffer old(std::move(*this));  // returned to the pool at the end of this scope
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

size_t ScratchBuffer::kept_bytes() {
  Pool& p = pool();
  std::lock_guard lock(p.mu);
  return p.kept;
}

}  // namespace foldpar
