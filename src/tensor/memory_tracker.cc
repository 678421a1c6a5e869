// Tracked allocator implementation: aligned_alloc plus exact byte counters under a mutex.
#include "tensor/memory_tracker.h"

#include <cstdlib>

#include "core/check.h"

namespace foldpar {

std::string_view mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::kParameters: return "parameters";
    case MemCategory::kGradients: return "gradients";
    case MemCategory::kOptimizer: return "optimizer";
    case MemCategory::kActivations: return "activations";
    case MemCategory::kComm: return "comm";
    case MemCategory::kWorkspace: return "workspace";
  }
  return "?";
}

MemoryTracker& MemoryTracker::process() {
  static MemoryTracker tracker;
  return tracker;
}

void* MemoryTracker::allocate(size_t bytes, MemCategory category) {
  const size_t rounded = ((bytes == 0 ? 1 : bytes) + kAlignment - 1) / kAlignment * kAlignment;
  void* ptr = std::aligned_alloc(kAlignment, rounded);
  if (ptr == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  const int c = static_cast<int>(category);
  stats_.current[c] += static_cast<int64_t>(bytes);
  if (stats_.current[c] > stats_.peak[c]) stats_.peak[c] = stats_.current[c];
  stats_.current_total += static_cast<int64_t>(bytes);
  if (stats_.current_total > stats_.peak_total) stats_.peak_total = stats_.current_total;
  ++stats_.live_allocations;
  ++stats_.total_allocations;
  return ptr;
}

void MemoryTracker::release(void* ptr, size_t bytes, MemCategory category) {
  if (ptr == nullptr) return;
  std::free(ptr);
  std::lock_guard<std::mutex> lock(mu_);
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

void MemoryTracker::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak = stats_.current;
  stats_.peak_total = stats_.current_total;
}

}  // namespace foldpar
