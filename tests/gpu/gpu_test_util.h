// Helpers of the GPU tests: skipping where no GPU is visible, pinned host memory for every
// tensor (the tests compare on the host; kernels address it over the bus), bf16 copies, and the GPU tolerance policy. Every GPU test starts with
// FP_REQUIRE_GPU(): it skips with the driver's reason when cudaGetDeviceCount fails or finds
// no device (or FAILS, when FOLDPAR_REQUIRE_GPU=1 is set, as scripts/gpu-check.sh does: on
// the GPU machine a skip would hide a broken driver), and otherwise the test asserts.
// A program that links this file and skipped a test without failing one prints
// kSkippedMarker last (a listener registered at start-up), and tests/gpu/CMakeLists.txt
// makes ctest report it Skipped, never Passed.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "backend/cuda/cuda_backend.h"
#include "tensor/tensor.h"

namespace foldpar::gpu_test {

// Tolerances of a CUDA op against the reference backend (fp64 accumulation), normwise
// relative as in core/tolerance.h.
//  - f32: the kernels accumulate in f32 like the fast CPU backend (kF32Op = 2e-5), and use
//    the __expf/rsqrtf intrinsics (2 ulp plus about 1.2 ulp per unit of |x| for __expf at
//    the scores of these tests, |x| < 30): 5e-5 keeps a margin of 2 without hiding a wrong
//    formula (errors of order 1).
//  - bf16 storage: inputs are exact bf16 values (the reference sees the same values widened
//    to f32), arithmetic is f32, and each output is rounded once to bf16, whose 8-bit
//    significand gives a relative error of at most 2^-8 = 3.9e-3 per rounding. 2^-7 allows
//    that rounding plus the f32 effects above with a margin of 2.
constexpr double kCudaF32Op = 5e-5;
constexpr double kCudaBf16Op = 1.0 / 128;
// A whole model step in f32 on the GPU against the CPU backend: op errors compound as in
// core/tolerance.h's kF32Model (1e-4); the intrinsics add a factor of about 2.
constexpr double kCudaF32Model = 2e-4;

// True when a CUDA device is visible; otherwise *why says why.
bool gpu_available(std::string* why);

// True when FOLDPAR_REQUIRE_GPU=1 is set in the environment: a GPU test fails instead of
// skipping. Any other value than unset, "" or "0" and "1" is itself a failure (named).
bool gpu_required();

// Printed (one line, with the counts) at the end of a program that skipped tests and failed
// none; the SKIP_REGULAR_EXPRESSION of tests/gpu/CMakeLists.txt matches it.
inline constexpr const char* kSkippedMarker = "foldpar-gpu-tests: skipped";

// Installs pinned host memory (use_cuda_memory(..., kPinnedHost)) under
// MemoryTracker::process() once per process (before the first tensor: FP_REQUIRE_GPU does).
// The program and gpu_bench use device memory; these tests read results on the host.
void use_pinned_memory_once();

// Backend options of the tests: every op waits for its kernels (sync_each_op), since the
// tests read pinned tensors on the host right after an op.
CudaBackendOptions synced_options();

// A copy of an f32 tensor rounded to bf16, and the same values widened back to f32.
Tensor to_bf16(const Tensor& f32);
Tensor bf16_values_as_f32(const Tensor& f32);

}  // namespace foldpar::gpu_test

#define FP_REQUIRE_GPU()                                                                      \
  do {                                                                                        \
    std::string fp_gpu_why_;                                                                  \
    if (!::foldpar::gpu_test::gpu_available(&fp_gpu_why_)) {                                  \
      if (::foldpar::gpu_test::gpu_required())                                                \
        FAIL() << "no GPU: " << fp_gpu_why_ << " (FOLDPAR_REQUIRE_GPU=1: this test may not skip)"; \
      GTEST_SKIP() << "no GPU: " << fp_gpu_why_ << " (GPU tests run only where a GPU exists)"; \
    }                                                                                         \
    ::foldpar::gpu_test::use_pinned_memory_once();                                           \
  } while (0)
