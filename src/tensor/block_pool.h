// BlockPool: a caching pool over a raw allocate/release pair, for memory whose allocation is
// slow or synchronizing (cudaMalloc/cudaFree: backend/cuda/device_memory.cc). Requests are
// rounded up to a size class (512 B below 1 MiB, 1 MiB above), a released block is kept on
// its class's free list and handed out again for a request of the same class, and when the
// source refuses a block the pool returns every cached block to it and asks once more. The
// pool never splits or merges blocks: a cached block serves exactly its size class.
//
// Source is any type with `void* allocate(size_t bytes)` (nullptr when it has no memory; the
// bytes are a size class) and `void release(void* ptr, size_t bytes)` (the same class).
// The pool does not know what the memory is; a CPU test runs it over malloc. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace foldpar {

struct BlockPoolStats {
  int64_t in_use_bytes = 0;     // size classes handed out and not yet released
  int64_t cached_bytes = 0;     // released blocks kept for reuse
  int64_t reserved_bytes = 0;   // in use + cached: what the source has given and not got back
  int64_t peak_reserved_bytes = 0;
  int64_t hits = 0;             // requests served from the cache
  int64_t source_allocations = 0;
  int64_t source_failures = 0;  // source refusals (each retried once after emptying the cache)
  int64_t trims = 0;            // times the cache was emptied back into the source
};

template <typename Source>
class BlockPool {
 public:
  static constexpr size_t kSmallGranule = 512;
  static constexpr size_t kLargeThreshold = size_t{1} << 20;
  static constexpr size_t kLargeGranule = size_t{1} << 20;

  explicit BlockPool(Source source) : source_(std::move(source)) {}
  ~BlockPool() { trim(); }
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // The size class of a request of `bytes` (>= 1 byte).
  static size_t size_class(size_t bytes) {
    const size_t b = bytes == 0 ? 1 : bytes;
    const size_t g = b < kLargeThreshold ? kSmallGranule : kLargeGranule;
    return (b + g - 1) / g * g;
  }

  // A block of at least `bytes` bytes, or nullptr when the source has none even after the
  // cache went back to it.
  void* allocate(size_t bytes) {
    const size_t size = size_class(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = free_.find(size); it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.cached_bytes -= static_cast<int64_t>(size);
      stats_.in_use_bytes += static_cast<int64_t>(size);
      ++stats_.hits;
      return p;
    }
    void* p = source_.allocate(size);
    if (p == nullptr) {
      ++stats_.source_failures;
      trim_locked();
      p = source_.allocate(size);
      if (p == nullptr) return nullptr;
    }
    ++stats_.source_allocations;
    stats_.in_use_bytes += static_cast<int64_t>(size);
    stats_.reserved_bytes += static_cast<int64_t>(size);
    if (stats_.reserved_bytes > stats_.peak_reserved_bytes) stats_.peak_reserved_bytes = stats_.reserved_bytes;
    return p;
  }

  // `bytes` is the value given to allocate().
  void release(void* ptr, size_t bytes) {
    if (ptr == nullptr) return;
    const size_t size = size_class(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    free_[size].push_back(ptr);
    stats_.in_use_bytes -= static_cast<int64_t>(size);
    stats_.cached_bytes += static_cast<int64_t>(size);
  }

  // Returns every cached block to the source.
  void trim() {
    std::lock_guard<std::mutex> lock(mu_);
    trim_locked();
  }

  BlockPoolStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }
  Source& source() { return source_; }

 private:
  void trim_locked() {
    if (stats_.cached_bytes == 0) return;
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) source_.release(p, size);
      stats_.reserved_bytes -= static_cast<int64_t>(size * blocks.size());
      blocks.clear();
    }
    stats_.cached_bytes = 0;
    ++stats_.trims;
  }

  Source source_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // size class -> cached blocks
  BlockPoolStats stats_;
};

}  // namespace foldpar
