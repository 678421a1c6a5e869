// The benchmarks' yardsticks (backend/machine_rates.h): the ISA peak is the product it says
// it is, from a clock in the range of real x86 cores, and the best GEMM is the faster engine.
#include "backend/machine_rates.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace foldpar {
namespace {

TEST(IsaPeak, IsClockTimesLanesTimesFmaUnits) {
  const IsaPeak p = measure_isa_peak();
  // Thread CPU time, so a loaded machine still reads its clock: x86 cores run 0.8-6.5 GHz.
  EXPECT_GT(p.clock_ghz, 0.5);
  EXPECT_LT(p.clock_ghz, 7.0);
  EXPECT_TRUE(p.f32_lanes == 4 || p.f32_lanes == 8 || p.f32_lanes == 16) << p.f32_lanes;
  EXPECT_TRUE(p.fma_units == 1 || p.fma_units == 2) << p.fma_units;
  EXPECT_DOUBLE_EQ(p.f32_gflops, p.clock_ghz * p.f32_lanes * 2 * p.fma_units);
  EXPECT_TRUE(p.bf16_gflops == 0 || p.bf16_gflops == 2 * p.f32_gflops) << p.bf16_gflops;
  EXPECT_NE(p.how.find("fma units"), std::string::npos) << p.how;
}

TEST(IsaPeak, FmaUnitsByVendorAndFamily) {
  EXPECT_EQ(fma_units_per_cycle(false, 6, true), 2);   // Intel Xeon with AVX-512
  EXPECT_EQ(fma_units_per_cycle(false, 6, false), 2);  // Intel AVX2
  EXPECT_EQ(fma_units_per_cycle(true, 25, true), 1);   // Zen 4: 512 bits as two halves
  EXPECT_EQ(fma_units_per_cycle(true, 26, true), 2);   // Zen 5: two 512-bit FMA pipes
  EXPECT_EQ(fma_units_per_cycle(true, 25, false), 2);  // Zen 3: two 256-bit FMAs
}

TEST(GemmYardstick, IsTheFasterEngine) {
  const GemmYardstick y = measure_gemm_yardstick(256, 3);
  EXPECT_EQ(y.n, 256);
  EXPECT_GT(y.openblas_gflops, 0);
  EXPECT_GT(y.onednn_gflops, 0);
  EXPECT_DOUBLE_EQ(y.best_gflops, std::max(y.openblas_gflops, y.onednn_gflops));
  EXPECT_EQ(y.best_engine, y.openblas_gflops >= y.onednn_gflops ? "openblas" : "onednn");
}

}  // namespace
}  // namespace foldpar
