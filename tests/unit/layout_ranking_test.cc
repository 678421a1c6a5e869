// layout_ranking (app/layout_bench.h): which measured orders of layouts a sign test over the
// interleaved repetitions decides, and whether the plan's order agrees with them.
#include <gtest/gtest.h>

#include "app/layout_bench.h"

namespace foldpar {
namespace {

LayoutBenchRow row(const std::string& layout, int64_t seq, std::vector<double> samples, double predicted) {
  LayoutBenchRow r;
  r.layout = layout;
  r.seq = seq;
  r.step_samples_s = samples;
  std::vector<double> sorted = samples;
  std::sort(sorted.begin(), sorted.end());
  r.step_s = sorted[sorted.size() / 2];
  r.predicted_step_s = predicted;
  return r;
}

TEST(LayoutRanking, SignTestDecidesOnlyPairsOrderedInEveryRepetition) {
  // a beats c in all five; b beats c in all five; a and b trade places (median a < b).
  const std::vector<LayoutBenchRow> rows = {
      row("a", 2048, {1.00, 1.02, 0.99, 1.05, 1.01}, 0.90),
      row("b", 2048, {1.01, 1.00, 1.03, 1.02, 1.04}, 0.95),
      row("c", 2048, {1.10, 1.08, 1.12, 1.09, 1.11}, 1.00),
  };
  const std::vector<LayoutRanking> k = layout_ranking(rows);
  ASSERT_EQ(k.size(), 1u);
  EXPECT_EQ(k[0].seq, 2048);
  EXPECT_EQ(k[0].repetitions, 5);
  EXPECT_EQ(k[0].measured, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(k[0].planned, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(k[0].pairs, 3);
  EXPECT_EQ(k[0].decided, 2);  // a < c and b < c; a against b is not decided
  EXPECT_EQ(k[0].plan_agrees, 2);
  EXPECT_TRUE(k[0].plan_against.empty());
}

TEST(LayoutRanking, PlanReversingADecidedPairIsNamed) {
  const std::vector<LayoutBenchRow> rows = {
      row("tsp=2", 4096, {2.0, 2.1, 2.0, 2.05, 2.02}, 2.5),
      row("tp=2", 4096, {2.3, 2.4, 2.35, 2.3, 2.33}, 2.2),
  };
  const std::vector<LayoutRanking> k = layout_ranking(rows);
  ASSERT_EQ(k.size(), 1u);
  EXPECT_EQ(k[0].decided, 1);
  EXPECT_EQ(k[0].plan_agrees, 0);
  ASSERT_EQ(k[0].plan_against.size(), 1u);
  EXPECT_EQ(k[0].plan_against[0], "tp=2 planned ahead of tsp=2");
  const std::string text = layout_ranking_text(k);
  EXPECT_NE(text.find("1 of 1 pairs decided"), std::string::npos) << text;
  EXPECT_NE(text.find("reversed: tp=2 planned ahead of tsp=2"), std::string::npos) << text;
}

TEST(LayoutRanking, TooFewRepetitionsDecideNothing) {
  // Four repetitions, one layout always faster: below the sign test's minimum.
  const std::vector<LayoutBenchRow> rows = {
      row("x", 1024, {1.0, 1.0, 1.0, 1.0}, 1.0),
      row("y", 1024, {2.0, 2.0, 2.0, 2.0}, 2.0),
      row("z", 8192, {1.0, 1.0, 1.0, 1.0, 1.0}, 1.0),  // alone at its S: no ranking
  };
  const std::vector<LayoutRanking> k = layout_ranking(rows);
  ASSERT_EQ(k.size(), 1u);
  EXPECT_EQ(k[0].decided, 0);
  EXPECT_EQ(k[0].pairs, 1);
  EXPECT_NE(layout_ranking_text(k).find("too few repetitions (4) to decide a pair"), std::string::npos);
}

TEST(LayoutRanking, WithoutPredictionOnlyTheMeasuredOrder) {
  const std::vector<LayoutBenchRow> rows = {
      row("p", 2048, {3, 3, 3, 3, 3}, 0),
      row("q", 2048, {1, 1, 1, 1, 1}, 0),
  };
  const std::vector<LayoutRanking> k = layout_ranking(rows);
  ASSERT_EQ(k.size(), 1u);
  EXPECT_TRUE(k[0].planned.empty());
  EXPECT_EQ(k[0].measured, (std::vector<std::string>{"q", "p"}));
  EXPECT_EQ(k[0].decided, 1);
  EXPECT_EQ(k[0].plan_agrees, 0);
  EXPECT_EQ(layout_ranking_text(k).find("planned"), std::string::npos);
}

}  // namespace
}  // namespace foldpar
