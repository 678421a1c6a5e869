// Status, Result and the return macros.
#include <gtest/gtest.h>

#include "core/rng.h"
#include "core/status.h"

namespace foldpar {
namespace {

Result<int> parse_positive(int x) {
  if (x <= 0) return invalid_argument("value ({}) must be positive", x);
  return x;
}

Status twice(int x, int* out) {
  FP_ASSIGN_OR_RETURN(int v, parse_positive(x));
  *out = 2 * v;
  return Status();
}

TEST(Status, CarriesCodeAndMessage) {
  Status s = invalid_argument("n_kv_heads ({}) must be divisible by the TSP degree ({})", 6, 4);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.to_string(), "invalid argument: n_kv_heads (6) must be divisible by the TSP degree (4)");
  EXPECT_EQ(s.with_context("layout").message(), "layout: n_kv_heads (6) must be divisible by the TSP degree (4)");
  EXPECT_TRUE(Status().ok());
}

TEST(Status, DivergedIsItsOwnCode) {
  Status s = diverged("step {}: the loss is {}", 3, "nan");
  EXPECT_EQ(s.code(), StatusCode::kDiverged);
  EXPECT_EQ(s.to_string(), "diverged: step 3: the loss is nan");
}

TEST(Status, MacrosPropagate) {
  int out = 0;
  EXPECT_TRUE(twice(3, &out).ok());
  EXPECT_EQ(out, 6);
  Status s = twice(-1, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("(-1)"), std::string::npos);
  EXPECT_EQ(out, 6);
}

TEST(Rng, CounterBasedIsDeterministicAndIndependentOfOrder) {
  const uint64_t s = stream_id("model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(normal_at(7, s, 123), normal_at(7, s, 123));
  EXPECT_NE(normal_at(7, s, 123), normal_at(8, s, 123));
  EXPECT_NE(normal_at(7, s, 123), normal_at(7, s + 1, 123));
  // Moments of 200k samples: mean 0 +- 5 sigma/sqrt(n), variance 1 +- 5 * sqrt(2/n).
  const int n = 200000;
  double sum = 0, sq = 0;
  for (int i = 0; i < n; ++i) {
    const double z = normal_at(1, s, i);
    sum += z;
    sq += z * z;
  }
  EXPECT_NEAR(sum / n, 0.0, 5.0 / std::sqrt(n));
  EXPECT_NEAR(sq / n, 1.0, 5.0 * std::sqrt(2.0 / n));
}

TEST(Rng, SequentialStateRoundTrips) {
  Rng a(42);
  a.next_u64();
  Rng b(0);
  b.set_state(a.state());
  for (int i = 0; i < 10; ++i) EXPECT_EQ(a.next_u64(), b.next_u64());
  for (int i = 0; i < 1000; ++i) EXPECT_LT(a.below(7), 7u);
}

}  // namespace
}  // namespace foldpar
