// What this CPU core can do, as the yardsticks benchmarks divide by: the best f32 GEMM the
// machine runs (the faster of the engines, measured in the caller's process and moment) and
// the instruction-set peak computed from the measured clock, the vector width and the FMA
// units. Not here: choosing an engine (cpu/gemm_engine.h) or timing whole steps (app/).
// Implemented by the CPU backend (cpu/machine_rates.cc).
#pragma once

#include <string>

namespace foldpar {

// One core's f32 GEMM rate, n x n x n, each engine's median of `reps` after one warm-up.
struct GemmYardstick {
  int n = 0;
  double openblas_gflops = 0, onednn_gflops = 0;
  double best_gflops = 0;          // the larger of the two
  std::string best_engine;         // "openblas" or "onednn"
};
GemmYardstick measure_gemm_yardstick(int n = 2048, int reps = 5);

// The peak of one core: clock x lanes x 2 (a fused multiply-add is two flops) x FMA units.
struct IsaPeak {
  double clock_ghz = 0;     // measured: a chain of dependent integer multiplies, 3 cycles each
  int f32_lanes = 0;        // 16 (AVX-512), 8 (AVX2/AVX), 4 (SSE)
  int fma_units = 0;        // per core, by vendor and ISA (cpuid does not tell): see .cc
  double f32_gflops = 0;    // clock x lanes x 2 x units
  double bf16_gflops = 0;   // AVX512_BF16's dot product: twice f32 (0 without it)
  double amx_bf16_gflops = 0;  // AMX TDPBF16PS: 1024 flops per cycle (0 without AMX)
  std::string how;          // the line saying how it was computed
};
IsaPeak measure_isa_peak();

// 512-bit (AVX-512) or 256-bit FMAs a core issues per cycle, which cpuid does not tell: two on
// Intel cores with AVX2 or server AVX-512 and on AMD Zen 5 (CPU family 26: a native 512-bit
// datapath with two FMA pipes); one 512-bit FMA on Zen 4 (family 25, which splits it over its
// two 256-bit units); two 256-bit FMAs on AMD cores without AVX-512.
int fma_units_per_cycle(bool amd, int cpu_family, bool avx512);

}  // namespace foldpar
