// The benchmarks' yardsticks (machine_rates.h): the best engine's GEMM rate and the ISA peak.
#include "backend/machine_rates.h"

#include <fmt/format.h>

#include <algorithm>
#include <ctime>
#include <cstdint>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "backend/cpu/gemm_engine.h"
#include "core/timing.h"

namespace foldpar {
namespace {

double gemm_gflops(GemmEngine engine, int n, int reps) {
  std::vector<float> a(static_cast<size_t>(n) * n), b(a.size()), c(a.size());
  // Varied values: constant inputs let some kernels' figures look better than real data's.
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    b[i] = static_cast<float>((i * 40503u) % 997) / 997.0f - 0.5f;
  }
  const MatmulDims d{n, n, n, n, n};
  const double s = median_seconds({.reps = reps}, [&] {
    gemm_f32(engine, d, false, false, a.data(), b.data(), c.data(), 1.0f, 0.0f);
  });
  return 2.0 * n * n * static_cast<double>(n) / s / 1e9;
}

// Cycles per second of this core, at whatever turbo it runs right now: a chain of dependent
// 64-bit integer multiplies, 3 cycles each on Intel cores since Nehalem and on AMD Zen. (A
// chain of adds is not a clock: Golden Cove folds add-immediates and ran them 3 a cycle.)
// This thread's CPU time: the clock is counted while the thread runs, so a loaded machine
// (other processes on the core) does not read as a slow clock.
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double measure_clock_ghz() {
#if defined(__x86_64__)
  constexpr int64_t kMulsPerIter = 100, kIters = 1'000'000, kCyclesPerMul = 3;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    uint64_t x = 3;
    const double t0 = thread_cpu_seconds();
    for (int64_t i = 0; i < kIters; ++i) {
      // 100 dependent multiplies; the asm keeps the compiler from folding them.
      asm volatile(
          ".rept 100\n\t"
          "imul %0, %0\n\t"
          ".endr"
          : "+r"(x));
    }
    const double s = thread_cpu_seconds() - t0;
    best = std::max(best, static_cast<double>(kMulsPerIter * kIters * kCyclesPerMul) / s / 1e9);
  }
  return best;
#else
  return 0;
#endif
}

}  // namespace

GemmYardstick measure_gemm_yardstick(int n, int reps) {
  GemmYardstick y;
  y.n = n;
  y.openblas_gflops = gemm_gflops(GemmEngine::kOpenBlas, n, reps);
  y.onednn_gflops = gemm_gflops(GemmEngine::kOneDnn, n, reps);
  const bool blas = y.openblas_gflops >= y.onednn_gflops;
  y.best_gflops = blas ? y.openblas_gflops : y.onednn_gflops;
  y.best_engine = blas ? "openblas" : "onednn";
  return y;
}

int fma_units_per_cycle(bool amd, int cpu_family, bool avx512) {
  // Intel server cores with AVX-512 (Skylake-SP Gold and Platinum, Ice Lake-SP, Sapphire
  // Rapids) and AVX2 cores issue two vector FMAs a cycle. AMD Zen 4 (family 25) runs a
  // 512-bit FMA as two halves on its two 256-bit units, one a cycle; Zen 5 (family 26) has a
  // 512-bit datapath with two FMA pipes.
  if (amd && avx512 && cpu_family < 26) return 1;
  return 2;
}

IsaPeak measure_isa_peak() {
  IsaPeak p;
  p.clock_ghz = measure_clock_ghz();
  const GemmEngineReport& r = gemm_engine_report();
  const std::string& isa = r.cpu_isa;
  const bool avx512 = isa.rfind("avx512", 0) == 0;
  p.f32_lanes = avx512 ? 16 : (isa == "avx2" || isa == "avx") ? 8 : 4;
  bool amd = false;
  int family = 0;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  __cpuid(0, a, b, c, d);
  amd = b == 0x68747541;  // "Auth"enticAMD
  __cpuid(1, a, b, c, d);
  family = static_cast<int>((a >> 8) & 0xf);
  if (family == 0xf) family += static_cast<int>((a >> 20) & 0xff);
#endif
  p.fma_units = fma_units_per_cycle(amd, family, avx512);
  p.f32_gflops = p.clock_ghz * p.f32_lanes * 2 * p.fma_units;
  if (isa.find("avx512_bf16") != std::string::npos) p.bf16_gflops = 2 * p.f32_gflops;
  if (isa.find("amx_bf16") != std::string::npos) p.amx_bf16_gflops = p.clock_ghz * 1024;
  p.how = fmt::format(
      "isa peak {:.1f} GFLOP/s f32 = {:.2f} GHz (measured: dependent integer multiplies) x {} lanes x 2 (fma) x {} fma "
      "units ({}family {}, {})",
      p.f32_gflops, p.clock_ghz, p.f32_lanes, p.fma_units, amd ? "amd " : "", family, isa);
  if (p.bf16_gflops > 0) p.how += fmt::format("; bf16 dot products {:.1f}", p.bf16_gflops);
  if (p.amx_bf16_gflops > 0) p.how += fmt::format("; amx bf16 {:.1f} (1024 flops/cycle)", p.amx_bf16_gflops);
  return p;
}

}  // namespace foldpar
