// The bf16 attention kernel's fused row steps (backend/cpu/bf16_score_rows.h) against e^x in
// double: exp16's error bound and its edges (exact 1 at 0, exact 0 below the cutoff and at
// -inf, NaN kept), and each row function's bf16 outputs, f32 sums and masking on rows of
// every length around the 16-lane width; and the run rounding of bf16_round.h against
// f32_to_bf16. Each runs on whichever build the machine gets (AVX-512 intrinsics, or the
// portable loops): both must meet the same contract.
#include "backend/cpu/bf16_score_rows.h"
#include "backend/cpu/bf16_round.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace foldpar {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

#if defined(FOLDPAR_AVX512_BF16)
std::vector<float> exp16_of(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  size_t i = 0;
  for (; i + 16 <= x.size(); i += 16) _mm512_storeu_ps(y.data() + i, flash::exp16(_mm512_loadu_ps(x.data() + i)));
  for (; i < x.size(); ++i) {
    alignas(64) float v[16] = {x[i]};
    _mm512_store_ps(v, flash::exp16(_mm512_load_ps(v)));
    y[i] = v[0];
  }
  return y;
}
#endif

TEST(Exp16, RelativeErrorBelowSixMillionthsOverItsRange) {
#if !defined(FOLDPAR_AVX512_BF16)
  GTEST_SKIP() << "built without AVX-512 BF16: the rows use vec::exp (vec_math_test checks it)";
#else
  std::vector<float> x;
  const int64_t n = int64_t{1} << 22;
  for (int64_t i = 0; i <= n; ++i) x.push_back(static_cast<float>(-87.3 + (88.7 + 87.3) * double(i) / double(n)));
  for (float v = -1.0f; v <= 1.0f; v += 1.0f / 4096) x.push_back(v);  // the range where P lives
  const std::vector<float> y = exp16_of(x);
  double worst = 0;
  float worst_x = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp(static_cast<double>(x[i]));
    const double rel = std::abs(y[i] - want) / want;
    if (rel > worst) {
      worst = rel;
      worst_x = x[i];
    }
  }
  // The header's claim: the polynomial's 5.4e-6 plus f32 rounding. bf16's half ulp is 2^-9.
  EXPECT_LT(worst, 6e-6) << "at x = " << worst_x;
#endif
}

TEST(Exp16, EdgesZeroOneNaNAndSaturation) {
#if !defined(FOLDPAR_AVX512_BF16)
  GTEST_SKIP() << "built without AVX-512 BF16";
#else
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {0.0f, -kInf, -87.31f, -1000.0f, nan, 100.0f, kInf, -87.3f};
  const std::vector<float> y = exp16_of(x);
  EXPECT_EQ(y[0], 1.0f);  // the row's max gives P = 1 exactly
  EXPECT_EQ(y[1], 0.0f);  // a masked score
  EXPECT_EQ(y[2], 0.0f);
  EXPECT_EQ(y[3], 0.0f);
  EXPECT_TRUE(std::isnan(y[4]));
  EXPECT_NEAR(y[5], std::exp(88.7), std::exp(88.7) * 1e-5);  // saturates like vec::exp
  EXPECT_NEAR(y[6], std::exp(88.7), std::exp(88.7) * 1e-5);
  EXPECT_GT(y[7], 0.0f);
  EXPECT_TRUE(std::isnormal(y[7]));
#endif
}

// The bf16 nearest to `want` or one of its two neighbours: a value within exp16's 6e-6 of a
// rounding boundary may round the other way. Counts how often that happened.
struct Bf16Check {
  int64_t checked = 0, off_by_one = 0;
  void expect(bf16 got, double want, const char* what, int64_t j) {
    ++checked;
    const bf16 exact = f32_to_bf16(static_cast<float>(want));
    if (got.bits == exact.bits) return;
    const int diff = std::abs(static_cast<int>(got.bits) - static_cast<int>(exact.bits));
    const bool same_sign = (got.bits >> 15) == (exact.bits >> 15);
    EXPECT_TRUE(same_sign && diff == 1) << what << "[" << j << "] = " << bf16_to_f32(got) << ", want " << want;
    ++off_by_one;
  }
};

struct Row {
  std::vector<float> s, dp;
};

Row random_row(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  Row r;
  for (int64_t j = 0; j < n; ++j) {
    r.s.push_back(normal(rng));
    r.dp.push_back(normal(rng));
  }
  return r;
}

TEST(Bf16ScoreRows, ExpSumRoundMatchesDoubleOnEveryLength) {
  std::mt19937 rng(7);
  Bf16Check check;
  for (int64_t n = 1; n <= 70; ++n) {
    Row r = random_row(rng, n);
    if (n % 5 == 0) r.s[n / 2] = -kInf;  // masked before the step: P must be exactly 0
    float shift = -kInf;
    for (float v : r.s) shift = std::max(shift, v);
    std::vector<bf16> p(n + 16, f32_to_bf16(-7.0f));  // the tail past n must stay untouched
    const float sum = flash::exp_sum_round(r.s.data(), shift, n, p.data());
    double want_sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      const double e = std::exp(double(r.s[j]) - double(shift));
      want_sum += e;
      if (r.s[j] == -kInf) {
        EXPECT_EQ(p[j].bits, f32_to_bf16(0.0f).bits) << "n = " << n;
      } else {
        check.expect(p[j], e, "P", j);
      }
    }
    EXPECT_NEAR(sum, want_sum, want_sum * 1e-5) << "n = " << n;
    for (int64_t j = n; j < n + 16; ++j) EXPECT_EQ(bf16_to_f32(p[j]), -7.0f) << "wrote past n = " << n;
  }
  // Off by one only near a boundary: 6e-6 of bf16's ulp of 2^-7 relative, about 0.1%.
  EXPECT_LT(check.off_by_one * 100, check.checked) << check.off_by_one << " of " << check.checked;
}

// One key's column (key_probabilities_and_grads_round): rows r = 0..n-1 with their own lse,
// delta and key bounds.
template <bool kMasked>
void check_backward_rows(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 5.0f);
  Bf16Check check;
  int64_t hidden_seen = 0, seen = 0;
  for (int64_t n = 1; n <= 70; ++n) {
    const Row r = random_row(rng, n);
    std::vector<float> lse(n), delta(n);
    std::vector<int32_t> lo(n), hi(n);
    const int32_t key = 120;
    for (int64_t i = 0; i < n; ++i) {
      lse[i] = uniform(rng);
      delta[i] = uniform(rng) / 4;
      // Query rows at positions 100 + i, some with a window of 8: the key is hidden from
      // rows before it and from rows whose window ends after it.
      hi[i] = static_cast<int32_t>(100 + i);
      lo[i] = i % 3 == 0 ? hi[i] - 7 : std::numeric_limits<int32_t>::min();
    }
    std::vector<bf16> p(n + 16, f32_to_bf16(-7.0f)), ds(n + 16, f32_to_bf16(-7.0f));
    flash::key_probabilities_and_grads_round<kMasked>(r.s.data(), r.dp.data(), key, lo.data(), hi.data(), n,
                                                      lse.data(), delta.data(), p.data(), ds.data());
    for (int64_t i = 0; i < n; ++i) {
      if (kMasked && flash::hidden(key, flash::KeyBound{lo[i], hi[i]})) {
        ++hidden_seen;
        EXPECT_EQ(p[i].bits, f32_to_bf16(0.0f).bits) << "n = " << n << ", r = " << i;
        EXPECT_EQ(bf16_to_f32(ds[i]), 0.0f) << "n = " << n << ", r = " << i;
        continue;
      }
      ++seen;
      const double e = std::exp(double(r.s[i]) - double(lse[i]));
      check.expect(p[i], e, "P", i);
      // dS from the f32 P: the kernel's f32 product, the exact one within 6e-6 + 2^-24.
      check.expect(ds[i], e * (double(r.dp[i]) - double(delta[i])), "dS", i);
    }
    for (int64_t i = n; i < n + 16; ++i) {
      EXPECT_EQ(bf16_to_f32(p[i]), -7.0f) << "wrote past n = " << n;
      EXPECT_EQ(bf16_to_f32(ds[i]), -7.0f) << "wrote past n = " << n;
    }
  }
  EXPECT_EQ(hidden_seen > 0, kMasked);
  EXPECT_GT(seen, 0);
  EXPECT_LT(check.off_by_one * 100, check.checked) << check.off_by_one << " of " << check.checked;
}

TEST(Bf16ScoreRows, ProbabilitiesAndGradsMatchDouble) { check_backward_rows<false>(11); }
TEST(Bf16ScoreRows, ProbabilitiesAndGradsMaskHiddenKeys) { check_backward_rows<true>(13); }

TEST(Bf16ScoreRows, NaNScoresStayNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> s(20, 0.5f), dp(20, 1.0f);
  s[17] = nan;
  std::vector<bf16> p(20), ds(20);
  const float sum = flash::exp_sum_round(s.data(), 0.5f, 20, p.data());
  EXPECT_TRUE(std::isnan(sum));
  EXPECT_TRUE(std::isnan(bf16_to_f32(p[17])));
  EXPECT_EQ(bf16_to_f32(p[3]), 1.0f);
  const std::vector<float> lse(20, 0.5f), delta(20, 0.0f);
  const std::vector<int32_t> lo(20, 0), hi(20, 0);
  flash::key_probabilities_and_grads_round<false>(s.data(), dp.data(), 0, lo.data(), hi.data(), 20, lse.data(),
                                                  delta.data(), p.data(), ds.data());
  EXPECT_TRUE(std::isnan(bf16_to_f32(p[17])));
  EXPECT_TRUE(std::isnan(bf16_to_f32(ds[17])));
  EXPECT_EQ(bf16_to_f32(ds[3]), 1.0f);
}

// round_run_to_bf16 (bf16_round.h) gives f32_to_bf16's bits on every length around the
// 16-lane width, for normal values, ties, zeros of both signs, infinities, NaN and overflow;
// subnormals become a zero of their sign; nothing past n is written.
TEST(RoundRunToBf16, SameBitsAsTheScalarRounding) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> special = {0.0f, -0.0f, kInf, -kInf, nan, -nan, 3.4e38f, -3.4e38f,
                                      std::bit_cast<float>(0x3f808000u),   // a tie, rounds down to even
                                      std::bit_cast<float>(0x3f818000u),   // a tie, rounds up to even
                                      std::bit_cast<float>(0x7f7fffffu)};  // the largest float: rounds to inf
  for (int64_t n = 0; n <= 50; ++n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[i] = i < int64_t(special.size()) && n > 30 ? special[i] : normal(rng);
    std::vector<bf16> y(n + 16, f32_to_bf16(-7.0f));
    round_run_to_bf16(x.data(), n, y.data());
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(y[i].bits, f32_to_bf16(x[i]).bits) << "n = " << n << ", x = " << x[i];
    for (int64_t i = n; i < n + 16; ++i) EXPECT_EQ(bf16_to_f32(y[i]), -7.0f) << "wrote past n = " << n;
  }
  const std::vector<float> subnormal = {1e-39f, -1e-39f, std::numeric_limits<float>::denorm_min()};
  std::vector<bf16> y(3);
  round_run_to_bf16(subnormal.data(), 3, y.data());
  for (int i = 0; i < 3; ++i) {
    if (flash::kScoreRowsAvx512) {
      EXPECT_EQ(bf16_to_f32(y[i]), 0.0f);
      EXPECT_EQ(std::signbit(bf16_to_f32(y[i])), std::signbit(subnormal[i]));
    } else {
      EXPECT_EQ(y[i].bits, f32_to_bf16(subnormal[i]).bits);
    }
  }
}

}  // namespace
}  // namespace foldpar
