// core/timing.h: the quantile and median every benchmark reports, and how many calls
// median_seconds makes with and without a budget.
#include <gtest/gtest.h>

#include "core/timing.h"

namespace foldpar {
namespace {

TEST(Timing, MedianOfOddAndEvenCounts) {
  EXPECT_EQ(median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_EQ(median({4.0, 1.0, 3.0, 2.0}), 2.5);  // the mean of the two middle values
  EXPECT_EQ(median({7.0}), 7.0);
}

TEST(Timing, QuantileInterpolatesBetweenSortedValues) {
  const std::vector<double> v = {10, 0, 30, 20, 40};  // sorted: 0 10 20 30 40
  EXPECT_EQ(quantile(v, 0.0), 0.0);
  EXPECT_EQ(quantile(v, 1.0), 40.0);
  EXPECT_EQ(quantile(v, 0.25), 10.0);
  EXPECT_DOUBLE_EQ(quantile(v, 0.1), 4.0);  // 0.4 of the way from 0 to 10
  EXPECT_DOUBLE_EQ(quantile({1.0, 2.0}, 0.75), 1.75);
}

TEST(Timing, EmptyValuesAreABug) {
  EXPECT_DEATH(median({}), "quantile of no values");
  EXPECT_DEATH(quantile({1.0}, 1.5), "outside");
}

TEST(Timing, MedianSecondsCallsWarmUpPlusReps) {
  int calls = 0;
  const double s = median_seconds({.reps = 4}, [&] { ++calls; });
  EXPECT_EQ(calls, 5);
  EXPECT_GE(s, 0.0);
}

TEST(Timing, BudgetCutsTheRepsToTheMinimum) {
  int calls = 0;
  median_seconds({.reps = 50, .budget_seconds = 1e-12, .min_reps = 3}, [&] { ++calls; });
  EXPECT_EQ(calls, 4);  // the warm-up shows one call exceeds the whole budget
}

TEST(Timing, BothClocksAdvanceWithWork) {
  const double cpu0 = now_seconds(Clock::kThreadCpu), wall0 = now_seconds(Clock::kWall);
  volatile double acc = 0;
  for (int i = 0; i < 2000000; ++i) acc = acc + 1e-9 * i;
  EXPECT_GT(now_seconds(Clock::kThreadCpu), cpu0);
  EXPECT_GT(now_seconds(Clock::kWall), wall0);
}

}  // namespace
}  // namespace foldpar
