// The tracked allocator: every byte of tensor storage in foldpar comes from here, tagged
// with what it is for. Later issues compare these peaks across parallel layouts and hold
// them to formulas, so the counts are exact: a tensor of n elements of dtype t counts
// n * dtype_size(t) bytes, alignment padding is not counted, and a view counts nothing.
//
// MemoryTracker::process() is the one process-wide instance (it mirrors the process heap,
// as cudaMalloc mirrors a device); tests may build private instances. Thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string_view>

namespace foldpar {

enum class MemCategory : uint8_t {
  kParameters = 0,   // model weights (and fp32 master weights)
  kGradients,        // gradients of the weights
  kOptimizer,        // optimizer state (AdamW moments)
  kActivations,      // tensors saved for backward, and forward/backward outputs
  kComm,             // communication buffers (weight shards in flight, gathered K/V)
  kWorkspace,        // scratch that lives only inside one op or one block
};
constexpr int kNumMemCategories = 6;
std::string_view mem_category_name(MemCategory c);  // "parameters", "gradients", ...

struct MemoryStats {
  std::array<int64_t, kNumMemCategories> current{};  // bytes live now, per category
  std::array<int64_t, kNumMemCategories> peak{};     // highest `current` seen, per category
  int64_t current_total = 0;                         // sum of current over categories
  int64_t peak_total = 0;                            // highest current_total seen (not the sum of peaks)
  int64_t live_allocations = 0;
  int64_t total_allocations = 0;                     // allocations ever made

  int64_t current_of(MemCategory c) const { return current[static_cast<int>(c)]; }
  int64_t peak_of(MemCategory c) const { return peak[static_cast<int>(c)]; }
};

class MemoryTracker {
 public:
  static constexpr size_t kAlignment = 64;

  MemoryTracker() = default;
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  static MemoryTracker& process();

  // Returns kAlignment-aligned memory of at least max(bytes, 1) bytes, counted as `bytes`;
  // nullptr when the system is out of memory (the caller turns that into a Status).
  void* allocate(size_t bytes, MemCategory category);
  // `bytes` and `category` must be those given to allocate().
  void release(void* ptr, size_t bytes, MemCategory category);

  MemoryStats stats() const;
  // Sets every peak to the current value, so the next reading is the peak of what follows.
  void reset_peaks();

 private:
  mutable std::mutex mu_;
  MemoryStats stats_;
};

}  // namespace foldpar
