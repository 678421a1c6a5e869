// The 1F1B order (parallel/pipeline/pipeline_schedule.h), held to its definition: every
// micro-batch's forward before its backward, forwards and backwards each in micro-batch
// order, p-s-1 warm-up forwards, at most p-s micro-batches in flight on stage s (stage 0:
// p), and a simulation of every stage's order with blocking receives and non-blocking sends
// that must finish (no deadlock) in exactly the 1F1B time of m+p-1 forward and backward
// slots per stage.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "parallel/pipeline/pipeline_schedule.h"

namespace foldpar {
namespace {

using Kind = PipelineOp::Kind;

TEST(OneFOneB, OrderWarmUpAndInFlight) {
  for (int p = 1; p <= 5; ++p)
    for (int m = 1; m <= 9; ++m)
      for (int s = 0; s < p; ++s) {
        const std::vector<PipelineOp> ops = one_f_one_b(p, s, m);
        ASSERT_EQ(ops.size(), static_cast<size_t>(2 * m));
        int next_f = 0, next_b = 0;
        for (const PipelineOp& op : ops) {
          if (op.kind == Kind::kForward) {
            EXPECT_EQ(op.micro_batch, next_f++);
          } else {
            EXPECT_EQ(op.micro_batch, next_b++);
            EXPECT_LT(op.micro_batch, next_f) << "backward before its forward";
          }
        }
        const int warmup = std::min(p - s - 1, m);
        for (int i = 0; i < warmup; ++i) EXPECT_EQ(ops[i].kind, Kind::kForward);
        EXPECT_EQ(max_in_flight(ops), std::min(p - s, m)) << "p " << p << " s " << s << " m " << m;
      }
  const std::vector<PipelineOp> want = {{Kind::kForward, 0}, {Kind::kForward, 1},  {Kind::kBackward, 0},
                                        {Kind::kForward, 2}, {Kind::kBackward, 1}, {Kind::kBackward, 2}};
  EXPECT_EQ(one_f_one_b(3, 1, 3), want);
}

// Every op takes one time slot; F(i) on stage s needs F(i) of s-1 done, B(i) needs B(i) of
// s+1 done (the last stage: its own F(i)). Stages run their order, each op as soon as its
// input arrived. Returns the slots to finish, or -1 on a deadlock.
int simulate(int p, int m) {
  std::vector<std::vector<PipelineOp>> order(static_cast<size_t>(p));
  for (int s = 0; s < p; ++s) order[s] = one_f_one_b(p, s, m);
  std::vector<std::vector<int>> f_done(p, std::vector<int>(m, -1)), b_done(p, std::vector<int>(m, -1));
  std::vector<size_t> pc(static_cast<size_t>(p), 0);
  for (int t = 0; t < 4 * (m + p) + 4; ++t) {
    bool all = true;
    std::vector<std::pair<int, PipelineOp>> run;
    for (int s = 0; s < p; ++s) {
      if (pc[s] == order[s].size()) continue;
      all = false;
      const PipelineOp op = order[s][pc[s]];
      const int i = op.micro_batch;
      const bool ready = op.kind == Kind::kForward ? (s == 0 || (f_done[s - 1][i] >= 0 && f_done[s - 1][i] < t))
                                                   : (s == p - 1 ? f_done[s][i] >= 0 && f_done[s][i] < t
                                                                 : b_done[s + 1][i] >= 0 && b_done[s + 1][i] < t);
      if (ready) run.emplace_back(s, op);
    }
    if (all) return t;
    for (const auto& [s, op] : run) {
      (op.kind == Kind::kForward ? f_done : b_done)[s][op.micro_batch] = t;
      ++pc[s];
    }
  }
  return -1;
}

TEST(OneFOneB, EveryStageFinishesWithTheOneFOneBBubble) {
  for (int p = 1; p <= 6; ++p)
    for (int m = p; m <= 3 * p; ++m) {
      // Unit slots for F and B: 2m slots of work plus 2(p-1) slots of bubble per stage.
      EXPECT_EQ(simulate(p, m), 2 * (m + p - 1)) << "p " << p << " m " << m;
    }
}

}  // namespace
}  // namespace foldpar
