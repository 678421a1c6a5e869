// Tracked allocator implementation: aligned_alloc plus exact byte counters under a mutex.
#include "tensor/memory_tracker.h"

#include <algorithm>
#include <bit>
#include <iterator>

#include <cstdlib>
#include <cstring>

#include "core/check.h"
#include "tensor/storageless_allocator.h"

namespace foldpar {

std::string_view mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::kParameters: return "parameters";
    case MemCategory::kGradients: return "gradients";
    case MemCategory::kOptimizer: return "optimizer";
    case MemCategory::kActivations: return "activations";
    case MemCategory::kComm: return "comm";
    case MemCategory::kWorkspace: return "workspace";
    case MemCategory::kKvCache: return "kv_cache";
  }
  return "?";
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kCacheByDefault = false;
#else
constexpr bool kCacheByDefault = true;
#endif

MemoryTracker::MemoryTracker() : caching_(kCacheByDefault) {}
MemoryTracker::~MemoryTracker() { release_cache(); }

MemoryTracker& MemoryTracker::process() {
  static MemoryTracker tracker;
  return tracker;
}

MemoryTracker& MemoryTracker::host_staging() {
  static MemoryTracker tracker;
  return tracker;
}

namespace {
thread_local MemoryTracker* t_default_tracker = nullptr;
}  // namespace

MemoryTracker& MemoryTracker::current() {
  return t_default_tracker != nullptr ? *t_default_tracker : process();
}

std::unique_ptr<MemoryTracker> MemoryTracker::make_storageless(size_t reserve_bytes) {
  auto tracker = std::make_unique<MemoryTracker>();
  tracker->owned_allocator_ = std::make_unique<StoragelessAllocator>(
      reserve_bytes == 0 ? StoragelessAllocator::kDefaultReserveBytes : reserve_bytes);
  tracker->set_block_allocator(tracker->owned_allocator_.get());
  tracker->storageless_ = true;
  return tracker;
}

ScopedDefaultTracker::ScopedDefaultTracker(MemoryTracker& tracker)
    : tracker_(&tracker), previous_(t_default_tracker) {
  t_default_tracker = &tracker;
}

ScopedDefaultTracker::~ScopedDefaultTracker() {
  FP_CHECK(t_default_tracker == tracker_, "ScopedDefaultTracker destroyed out of order");
  t_default_tracker = previous_;
}

size_t MemoryTracker::block_size(size_t bytes) {
  const size_t b = bytes == 0 ? 1 : bytes;
  if (b < kCacheMinBytes) return (b + kAlignment - 1) / kAlignment * kAlignment;
  const size_t step = std::bit_floor(b) / kCacheClassesPerDoubling;  // >= 8 KiB: whole pages
  return (b + step - 1) / step * step;
}

void* MemoryTracker::allocate(size_t bytes, MemCategory category) {
  if (bytes > kMaxAllocationBytes) return nullptr;
  const size_t size = block_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* ptr = nullptr;
  // The most recently released block of the class (the last of its equal keys): the likeliest
  // to be in cache.
  if (auto it = cache_.upper_bound(size); it != cache_.begin() && std::prev(it)->first == size) {
    --it;
    ptr = it->second->ptr;
    lru_.erase(it->second);
    cache_.erase(it);
    stats_.cached_bytes -= static_cast<int64_t>(size);
    ++stats_.cache_hits;
  } else {
    ptr = allocate_block(size);
    if (ptr == nullptr) {
      release_cache_locked();  // the cache may hold what the system now lacks
      ptr = allocate_block(size);
    }
    if (ptr == nullptr) return nullptr;
  }
  live_block_bytes_ += static_cast<int64_t>(size);
  high_water_bytes_ = std::max(high_water_bytes_, live_block_bytes_);
  const int c = static_cast<int>(category);
  stats_.current[c] += static_cast<int64_t>(bytes);
  if (stats_.current[c] > stats_.peak[c]) stats_.peak[c] = stats_.current[c];
  stats_.current_total += static_cast<int64_t>(bytes);
  if (stats_.current_total > stats_.peak_total) {
    stats_.peak_total = stats_.current_total;
    stats_.at_peak = stats_.current;
  }
  ++stats_.live_allocations;
  ++stats_.total_allocations;
  return ptr;
}

void MemoryTracker::release(void* ptr, size_t bytes, MemCategory category) {
  if (ptr == nullptr) return;
  const size_t size = block_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  live_block_bytes_ -= static_cast<int64_t>(size);
  if (caching_ && size >= kCacheMinBytes) {
    cache_.emplace(size, lru_.insert(lru_.end(), CachedBlock{size, ptr}));
    stats_.cached_bytes += static_cast<int64_t>(size);
    // At most twice as many bytes cached as were ever live at once (kCacheBoundFactor): the
    // least recently released go back to the system first.
    while (stats_.cached_bytes > kCacheBoundFactor * high_water_bytes_) {
      const CachedBlock oldest = lru_.front();
      auto [first, last] = cache_.equal_range(oldest.size);
      while (first != last && first->second != lru_.begin()) ++first;
      FP_CHECK(first != last, "the block cache lost a block of {} bytes", oldest.size);
      cache_.erase(first);
      lru_.pop_front();
      free_block(oldest.ptr, oldest.size);
      stats_.cached_bytes -= static_cast<int64_t>(oldest.size);
      ++stats_.cache_evictions;
    }
  } else {
    free_block(ptr, size);
  }
  const int c = static_cast<int>(category);
  stats_.current[c] -= static_cast<int64_t>(bytes);
  stats_.current_total -= static_cast<int64_t>(bytes);
  --stats_.live_allocations;
  FP_CHECK(stats_.current[c] >= 0 && stats_.live_allocations >= 0,
           "release of {} bytes of {} that were never allocated", bytes, mem_category_name(category));
}

MemoryStats MemoryTracker::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void MemoryTracker::release_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cache_locked();
}

void MemoryTracker::release_cache_locked() {
  for (const CachedBlock& b : lru_) free_block(b.ptr, b.size);
  lru_.clear();
  cache_.clear();
  stats_.cached_bytes = 0;
}

void MemoryTracker::set_caching(bool enabled) {
  std::lock_guard<std::mutex> lock(mu_);
  caching_ = enabled;
  if (!enabled) release_cache_locked();
}

void* MemoryTracker::allocate_block(size_t size) {
  return block_allocator_ != nullptr ? block_allocator_->allocate(size) : std::aligned_alloc(kAlignment, size);
}

void MemoryTracker::free_block(void* ptr, size_t size) {
  if (block_allocator_ != nullptr) {
    block_allocator_->release(ptr, size);
  } else {
    std::free(ptr);
  }
}

void BlockAllocator::fill_zero(void* ptr, size_t bytes) { std::memset(ptr, 0, bytes); }

void BlockAllocator::copy_in(void* block, const void* host, size_t bytes) { std::memcpy(block, host, bytes); }
void BlockAllocator::copy_out(void* host, const void* block, size_t bytes) { std::memcpy(host, block, bytes); }
void BlockAllocator::copy_within(void* dst, const void* src, size_t bytes) { std::memmove(dst, src, bytes); }

BlockAllocator* MemoryTracker::block_allocator() const {
  std::lock_guard<std::mutex> lock(mu_);
  return block_allocator_;
}

std::string MemoryTracker::failure_reason() const {
  BlockAllocator* a = block_allocator();
  return a != nullptr ? a->failure_reason() : std::string();
}

void MemoryTracker::fill_zero(void* ptr, size_t bytes) {
  if (bytes == 0) return;
  if (BlockAllocator* a = block_allocator()) {
    a->fill_zero(ptr, bytes);
  } else {
    std::memset(ptr, 0, bytes);
  }
}

void MemoryTracker::count_host_copy(int64_t bytes_in, int64_t bytes_out) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.host_bytes_in += bytes_in;
  stats_.host_bytes_out += bytes_out;
}

void MemoryTracker::copy_in(void* block, const void* host, size_t bytes) {
  if (bytes == 0) return;
  count_host_copy(static_cast<int64_t>(bytes), 0);
  if (BlockAllocator* a = block_allocator()) {
    a->copy_in(block, host, bytes);
  } else {
    std::memcpy(block, host, bytes);
  }
}

void MemoryTracker::copy_out(void* host, const void* block, size_t bytes) {
  if (bytes == 0) return;
  count_host_copy(0, static_cast<int64_t>(bytes));
  if (BlockAllocator* a = block_allocator()) {
    a->copy_out(host, block, bytes);
  } else {
    std::memcpy(host, block, bytes);
  }
}

void MemoryTracker::copy_within(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  if (BlockAllocator* a = block_allocator()) {
    a->copy_within(dst, src, bytes);
  } else {
    std::memmove(dst, src, bytes);
  }
}

void MemoryTracker::set_block_allocator(BlockAllocator* allocator) {
  std::lock_guard<std::mutex> lock(mu_);
  FP_CHECK(stats_.live_allocations == 0, "block allocator changed while {} blocks are live",
           stats_.live_allocations);
  release_cache_locked();
  block_allocator_ = allocator;
}

void MemoryTracker::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak = stats_.current;
  stats_.peak_total = stats_.current_total;
  stats_.at_peak = stats_.current;
}

}  // namespace foldpar
