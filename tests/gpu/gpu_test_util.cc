// GPU test helpers (gpu_test_util.h).
#include "gpu_test_util.h"

#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace foldpar::gpu_test {
namespace {

// Prints kSkippedMarker at the end of a run that skipped tests and failed none.
class SkipReporter : public ::testing::EmptyTestEventListener {
  void OnTestProgramEnd(const ::testing::UnitTest& unit) override {
    if (unit.Failed() || unit.skipped_test_count() == 0) return;
    std::printf("%s: %d of %d tests (no GPU; FOLDPAR_REQUIRE_GPU=1 makes that a failure)\n", kSkippedMarker,
                unit.skipped_test_count(), unit.test_to_run_count());
    std::fflush(stdout);
  }
};

// Registered before main(): every GPU test program reports its skips, whichever main() it has.
[[maybe_unused]] const bool kReporterInstalled = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new SkipReporter);
  return true;
}();

}  // namespace

bool gpu_available(std::string* why) { return cuda_device_count(why) > 0; }

bool gpu_required() {
  const char* v = std::getenv("FOLDPAR_REQUIRE_GPU");
  if (v == nullptr || std::string_view(v).empty() || std::string_view(v) == "0") return false;
  if (std::string_view(v) == "1") return true;
  ADD_FAILURE() << "FOLDPAR_REQUIRE_GPU='" << v << "' is not one of '', 0, 1";
  return true;
}

CudaBackendOptions synced_options() {
  CudaBackendOptions o;
  o.sync_each_op = true;
  return o;
}

void use_pinned_memory_once() {
  static const bool installed = [] {
    use_cuda_memory(MemoryTracker::process(), CudaMemory::kPinnedHost);
    return true;
  }();
  (void)installed;
}

Tensor to_bf16(const Tensor& f32) { return f32.to(DType::kBF16, MemCategory::kWorkspace); }

Tensor bf16_values_as_f32(const Tensor& f32) {
  return f32.to(DType::kBF16, MemCategory::kWorkspace).to(DType::kF32, MemCategory::kWorkspace);
}

}  // namespace foldpar::gpu_test
