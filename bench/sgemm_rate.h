// The single-thread sgemm rate every benchmark reports beside its own figures: OpenBLAS
// cblas_sgemm on square f32 matrices, median of several repetitions, measured in the same
// process as the figure it is compared with (the machine is shared and noisy).
#pragma once

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <vector>

namespace foldpar::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// GFLOP/s of C = A B for n x n x n, median of `reps` (after one warm-up call).
inline double sgemm_gflops(int n = 2048, int reps = 5) {
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  auto run = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(),
                n);
  };
  run();
  std::vector<double> secs;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * n * n * static_cast<double>(n) / median(secs) / 1e9;
}

}  // namespace foldpar::bench
