// The yardstick every benchmark reports beside its own figures: the best single-thread f32
// GEMM this machine runs (the faster of OpenBLAS and oneDNN on square matrices, each the
// median of several repetitions), measured in the same process as the figure it is compared
// with (the machine is shared and noisy). backend/machine_rates.h has the engines' figures
// and the instruction-set peak.
#pragma once

#include "backend/machine_rates.h"

namespace foldpar::bench {

// GFLOP/s of the faster engine for C = A B, n x n x n, median of `reps` (after a warm-up).
inline double sgemm_gflops(int n = 2048, int reps = 5) { return measure_gemm_yardstick(n, reps).best_gflops; }

}  // namespace foldpar::bench
