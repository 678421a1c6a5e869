// Checks every accuracy claim of backend/cpu/vec_math.h against std::exp in double: the
// error bound of vec::exp over its whole accurate range, its exact zero below the cutoff,
// saturation and NaN, and sigmoid's bound. The values are computed in plain loops over
// arrays, the form in which the kernels call these functions and GCC vectorizes them.
#include "backend/cpu/vec_math.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace foldpar {
namespace {

constexpr float kExpLo = -87.3f, kExpHi = 88.7f;  // vec::exp's accurate range

// |got - want| in units in the last place of want's f32 binade (want > 0 and normal).
double ulp_error(float got, double want) {
  int exponent = 0;
  std::frexp(want, &exponent);  // want = m * 2^exponent, m in [0.5, 1)
  return std::abs(static_cast<double>(got) - want) / std::ldexp(1.0, exponent - 24);
}

// 2^24 evenly spaced points of [lo, hi] plus every float in small windows around the points
// where the reduction changes: the range ends, n = 128 (127.5 ln2), and 0.
std::vector<float> sweep_points(float lo, float hi) {
  std::vector<float> x;
  const int64_t n = int64_t{1} << 24;
  for (int64_t i = 0; i <= n; ++i) x.push_back(static_cast<float>(lo + (double(hi) - lo) * double(i) / double(n)));
  for (float center : {lo, hi, 88.3762626647949f, 0.0f}) {
    float v = center;
    for (int i = 0; i < 20000; ++i) v = std::nextafter(v, -std::numeric_limits<float>::infinity());
    for (int i = 0; i < 40000; ++i, v = std::nextafter(v, std::numeric_limits<float>::infinity()))
      if (v >= lo && v <= hi) x.push_back(v);
  }
  return x;
}

std::vector<float> apply_exp(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = vec::exp(x[i]);
  return y;
}

TEST(VecExp, WithinTwoUlpOverItsRange) {
  const std::vector<float> x = sweep_points(kExpLo, kExpHi);
  const std::vector<float> y = apply_exp(x);
  double worst_ulp = 0, worst_rel = 0;
  float worst_x = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp(static_cast<double>(x[i]));
    const double e = ulp_error(y[i], want);
    if (e > worst_ulp) {
      worst_ulp = e;
      worst_x = x[i];
    }
    worst_rel = std::max(worst_rel, std::abs(y[i] - want) / want);
  }
  // The header claims below 2 ulp and a relative error below 2.4e-7 (2 * 2^-23).
  EXPECT_LT(worst_ulp, 2.0) << "at x = " << worst_x << ": " << vec::exp(worst_x) << " vs "
                            << std::exp(double(worst_x));
  EXPECT_LT(worst_rel, 2.4e-7);
}

TEST(VecExp, ExactlyZeroBelowTheCutoff) {
  const std::vector<float> x = {-std::numeric_limits<float>::infinity(), std::numeric_limits<float>::lowest(),
                                -1e30f, -1000.0f, -100.0f, -88.0f, std::nextafter(kExpLo, -100.0f)};
  const std::vector<float> y = apply_exp(x);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(y[i], 0.0f) << "x = " << x[i];
  // Masked scores are -inf minus a finite row max: still exactly zero.
  EXPECT_EQ(vec::exp(-std::numeric_limits<float>::infinity() - 3.0f), 0.0f);
  // The cutoff itself is still in range and normal.
  EXPECT_GT(vec::exp(kExpLo), std::numeric_limits<float>::min());
}

TEST(VecExp, SaturatesAboveRangeAndPropagatesNaN) {
  const float top = vec::exp(kExpHi);
  EXPECT_TRUE(std::isfinite(top));
  EXPECT_LT(ulp_error(top, std::exp(double(kExpHi))), 2.0);
  const std::vector<float> x = {std::nextafter(kExpHi, 100.0f), 89.0f, 1000.0f,
                                std::numeric_limits<float>::infinity()};
  const std::vector<float> y = apply_exp(x);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(y[i], top) << "x = " << x[i];
  const std::vector<float> nans = apply_exp({std::numeric_limits<float>::quiet_NaN(), -std::nanf("7"), std::nanf("1")});
  for (float v : nans) EXPECT_TRUE(std::isnan(v));
}

TEST(VecSigmoid, WithinFourUlpAndExactOne) {
  // sigmoid = 1 / (1 + e^-x): exp's < 2 ulp shrinks by e^-x / (1 + e^-x) <= 1, plus one
  // rounding each for the add and the division; claimed bound 4 ulp where the result is at
  // least 1e-37 (x >= -85).
  const std::vector<float> x = sweep_points(-85.0f, 88.7f);
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = vec::sigmoid(x[i]);
  double worst = 0;
  float worst_x = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = 1.0 / (1.0 + std::exp(-static_cast<double>(x[i])));
    const double e = ulp_error(y[i], want);
    if (e > worst) {
      worst = e;
      worst_x = x[i];
    }
  }
  EXPECT_LT(worst, 4.0) << "at x = " << worst_x;
  EXPECT_EQ(vec::sigmoid(87.5f), 1.0f);
  EXPECT_EQ(vec::sigmoid(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(vec::sigmoid(0.0f), 0.5f);
  const float tiny = vec::sigmoid(-100.0f);  // saturated: 1 / (1 + e^88.7)
  EXPECT_GT(tiny, 0.0f);
  EXPECT_LT(tiny, 3.1e-39f);
}

}  // namespace
}  // namespace foldpar
