// StoragelessAllocator: best-fit blocks inside one PROT_NONE reservation, and the fault
// handler that names a host access to one of them.
#include "tensor/storageless_allocator.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "core/check.h"

namespace foldpar {
namespace {

// Live reservations, readable from a signal handler without locks: slot i is in use when
// g_begin[i] != 0.
constexpr int kSlots = 64;
std::array<std::atomic<uintptr_t>, kSlots> g_begin{};
std::array<std::atomic<uintptr_t>, kSlots> g_end{};
std::array<std::atomic<const char*>, kSlots> g_label{};

int claim_slot(uintptr_t begin, uintptr_t end, const char* label) {
  for (int i = 0; i < kSlots; ++i) {
    uintptr_t expected = 0;
    if (g_begin[i].compare_exchange_strong(expected, begin)) {
      g_label[i].store(label);
      g_end[i].store(end);
      return i;
    }
  }
  return -1;  // more than kSlots live at once: faults are still faults, only unnamed
}

constexpr uint64_t kGranule = MemoryTracker::kAlignment;

}  // namespace

StoragelessAllocator::StoragelessAllocator(size_t reserve_bytes, const char* fault_label)
    : reserve_bytes_((reserve_bytes + 4095) / 4096 * 4096) {
  void* p = mmap(nullptr, reserve_bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  FP_CHECK(p != MAP_FAILED, "cannot reserve {} bytes of address space for storage-less tensors: {}", reserve_bytes_,
           std::strerror(errno));
  base_ = static_cast<char*>(p);
  insert_free(0, reserve_bytes_);
  slot_ = claim_slot(reinterpret_cast<uintptr_t>(base_), reinterpret_cast<uintptr_t>(base_) + reserve_bytes_,
                     fault_label);
}

StoragelessAllocator::~StoragelessAllocator() {
  if (slot_ >= 0) {
    g_end[slot_].store(0);
    g_begin[slot_].store(0);
  }
  munmap(base_, reserve_bytes_);
}

void StoragelessAllocator::insert_free(uint64_t offset, uint64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void StoragelessAllocator::erase_free(std::map<uint64_t, uint64_t>::iterator it) {
  auto [lo, hi] = free_by_size_.equal_range(it->second);
  for (auto s = lo; s != hi; ++s) {
    if (s->second == it->first) {
      free_by_size_.erase(s);
      break;
    }
  }
  free_by_offset_.erase(it);
}

void* StoragelessAllocator::allocate(size_t bytes) {
  const uint64_t size = (std::max<uint64_t>(bytes, 1) + kGranule - 1) / kGranule * kGranule;
  std::lock_guard<std::mutex> lock(mu_);
  auto fit = free_by_size_.lower_bound(size);
  if (fit == free_by_size_.end()) return nullptr;
  const uint64_t offset = fit->second, free_size = fit->first;
  erase_free(free_by_offset_.find(offset));
  if (free_size > size) insert_free(offset + size, free_size - size);
  return base_ + offset;
}

void StoragelessAllocator::release(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  FP_CHECK(contains(ptr), "release of {} outside the storage-less reservation", ptr);
  uint64_t offset = static_cast<uint64_t>(static_cast<char*>(ptr) - base_);
  uint64_t size = (std::max<uint64_t>(bytes, 1) + kGranule - 1) / kGranule * kGranule;
  std::lock_guard<std::mutex> lock(mu_);
  auto next = free_by_offset_.lower_bound(offset);
  FP_CHECK(next == free_by_offset_.end() || next->first >= offset + size, "storage-less block at offset {} freed twice",
           offset);
  if (next != free_by_offset_.end() && next->first == offset + size) {
    size += next->second;
    erase_free(next);
  }
  auto prev = free_by_offset_.lower_bound(offset);
  if (prev != free_by_offset_.begin()) {
    --prev;
    FP_CHECK(prev->first + prev->second <= offset, "storage-less block at offset {} freed twice", offset);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      erase_free(prev);
    }
  }
  insert_free(offset, size);
}

bool StoragelessAllocator::contains(const void* ptr) const {
  const char* p = static_cast<const char*>(ptr);
  return p >= base_ && p < base_ + reserve_bytes_;
}

namespace {

struct sigaction g_previous_segv, g_previous_bus;

void write_str(const char* s) {
  ssize_t ignored = write(STDERR_FILENO, s, strlen(s));
  (void)ignored;
}

void on_fault(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  bool ours = false;
  const char* label = "";
  for (int i = 0; i < kSlots && !ours; ++i) {
    const uintptr_t b = g_begin[i].load(), e = g_end[i].load();
    ours = b != 0 && addr >= b && addr < e;
    if (ours) label = g_label[i].load();
  }
  struct sigaction& previous = sig == SIGBUS ? g_previous_bus : g_previous_segv;
  if (ours) {
    char line[300];
    snprintf(line, sizeof line,
             "foldpar: host access to address %p inside %s: host code touched "
             "tensor data that only a Backend op may touch; backtrace:\n",
             info->si_addr, label != nullptr ? label : "?");
    write_str(line);
    void* frames[48];
    backtrace_symbols_fd(frames, backtrace(frames, 48), STDERR_FILENO);
  }
  // Die as the fault would have (or as the previous handler decides).
  if (previous.sa_flags & SA_SIGINFO) {
    if (previous.sa_sigaction != nullptr) return previous.sa_sigaction(sig, info, context);
  } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN && previous.sa_handler != nullptr) {
    return previous.sa_handler(sig);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void install_storageless_fault_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa{};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
    sigaction(SIGBUS, &sa, &g_previous_bus);
  });
}

}  // namespace foldpar
