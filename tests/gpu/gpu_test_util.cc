// GPU test helpers (gpu_test_util.h).
#include "gpu_test_util.h"

namespace foldpar::gpu_test {

bool gpu_available(std::string* why) { return cuda_device_count(why) > 0; }

void use_unified_memory_once() {
  static const bool installed = [] {
    use_cuda_unified_memory(MemoryTracker::process());
    return true;
  }();
  (void)installed;
}

Tensor to_bf16(const Tensor& f32) { return f32.to(DType::kBF16, MemCategory::kWorkspace); }

Tensor bf16_values_as_f32(const Tensor& f32) {
  return f32.to(DType::kBF16, MemCategory::kWorkspace).to(DType::kF32, MemCategory::kWorkspace);
}

}  // namespace foldpar::gpu_test
