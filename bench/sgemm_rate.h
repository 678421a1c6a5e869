// The single-thread sgemm rate every benchmark reports beside its own figures: OpenBLAS
// cblas_sgemm on square f32 matrices, median of several repetitions, measured in the same
// process as the figure it is compared with (the machine is shared and noisy).
#pragma once

#include <cblas.h>

#include <vector>

#include "core/timing.h"

namespace foldpar::bench {

// GFLOP/s of C = A B for n x n x n, median of `reps` (after one warm-up call).
inline double sgemm_gflops(int n = 2048, int reps = 5) {
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  const double s = median_seconds({.reps = reps}, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(),
                n);
  });
  return 2.0 * n * n * static_cast<double>(n) / s / 1e9;
}

}  // namespace foldpar::bench
