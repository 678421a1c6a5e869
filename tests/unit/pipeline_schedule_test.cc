// The 1F1B and interleaved 1F1B orders (parallel/pipeline/pipeline_schedule.h), held to
// their definitions. 1F1B: every
// micro-batch's forward before its backward, forwards and backwards each in micro-batch
// order, p-s-1 warm-up forwards, at most p-s micro-batches in flight on stage s (stage 0:
// p), and a simulation of every stage's order with blocking receives and non-blocking sends
// that must finish (no deadlock) in exactly the 1F1B time of m+p-1 forward and backward
// slots per stage. Interleaved (v chunks per rank): every (chunk, micro-batch) op exactly
// once, its forward before its backward, a producer on the same rank earlier, each chunk's
// stream in micro-batch order, the warm-up and in-flight counts, 2 (m v + p - 1) unit slots
// (the bubble (p - 1) / (m v + p - 1)), and every rank's order run together with the
// boundary's blocking points (receives taken, sends waited beyond the kept ones) finishing.
// ZB-H1: every F, B and W exactly once, F before B before W per micro-batch, F and B in
// 1F1B's order, 1F1B's saved state in flight plus at most s + 1 deferred W's on stage s, the
// step's length m (F + B + W) + (p - 1)(F + B - W) for op times with W <= F, B (unit times:
// p - 1 idle slots per stage against 1F1B's 3 (p - 1)), and every rank's order run with the
// boundary's blocking points finishing.
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>
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


// ---- Interleaved 1F1B: v chunks per rank, rank s holding global chunks s, s + p, ... ----

namespace interleaved {

struct Place {
  int rank = 0;   // which rank runs it
  size_t at = 0;  // its index in that rank's order
};

// Where each (kind, global chunk, micro-batch) op sits in the ranks' orders.
struct Orders {
  int p, m, v;
  std::vector<std::vector<PipelineOp>> ops;  // per rank
  std::vector<Place> where;                  // [kind][g][i]

  Orders(int p_, int m_, int v_) : p(p_), m(m_), v(v_), ops(static_cast<size_t>(p_)), where(2 * p_ * v_ * m_) {
    for (int s = 0; s < p; ++s) ops[s] = interleaved_one_f_one_b(p, s, m, v);
    place();
  }
  // Given orders of one chunk per rank (ZB-H1's, less its W ops, which move nothing).
  Orders(int p_, int m_, std::vector<std::vector<PipelineOp>> given)
      : p(p_), m(m_), v(1), ops(std::move(given)), where(2 * p_ * m_) {
    place();
  }
  void place() {
    for (int s = 0; s < p; ++s)
      for (size_t k = 0; k < ops[s].size(); ++k) where[index(ops[s][k], s)] = Place{s, k};
  }
  int global(const PipelineOp& op, int s) const { return op.chunk * p + s; }
  size_t index(Kind kind, int g, int i) const {
    return static_cast<size_t>(((kind == Kind::kForward ? 0 : 1) * p * v + g) * m + i);
  }
  size_t index(const PipelineOp& op, int s) const { return index(op.kind, global(op, s), op.micro_batch); }
  // The op whose output this op consumes: the previous chunk's forward, the next chunk's
  // backward, or (the last chunk's backward) its own forward; false for chunk 0's forward.
  bool producer(const PipelineOp& op, int s, size_t* out) const {
    const int g = global(op, s), last = p * v - 1;
    if (op.kind == Kind::kForward) {
      if (g == 0) return false;
      *out = index(Kind::kForward, g - 1, op.micro_batch);
    } else {
      *out = g == last ? index(Kind::kForward, g, op.micro_batch) : index(Kind::kBackward, g + 1, op.micro_batch);
    }
    return true;
  }
};

// Unit-time slots as the 1F1B simulation above: an op runs once its input was produced in
// an earlier slot. The slots to finish, or -1 on a deadlock.
int simulate_slots(const Orders& o) {
  std::vector<int> done(o.where.size(), -1);
  std::vector<size_t> pc(static_cast<size_t>(o.p), 0);
  const int limit = 8 * (o.m * o.v + o.p) + 8;
  for (int t = 0; t < limit; ++t) {
    bool all = true;
    std::vector<size_t> run;
    for (int s = 0; s < o.p; ++s) {
      if (pc[s] == o.ops[s].size()) continue;
      all = false;
      const PipelineOp& op = o.ops[s][pc[s]];
      size_t in = 0;
      if (!o.producer(op, s, &in) || (done[in] >= 0 && done[in] < t)) run.push_back(static_cast<size_t>(s));
    }
    if (all) return t;
    for (size_t s : run) done[o.index(o.ops[s][pc[s]++], static_cast<int>(s))] = t;
  }
  return -1;
}

// The boundary's blocking points (pipeline_boundary.h), every rank at once: an op takes its
// input (a receive, posted now if not before, done once the producer posted its send); then
// it posts its output's send to the consumer's rank and waits for its oldest sends while more
// than `kept` of a direction are in flight, a send being done once its receiver has posted
// the receive; then it posts the receive of its own next op (pipeline_model.cc's order); at
// the end it waits for every send. A message between ops of one rank (p = 1, or the last chunk's backward) is local.
// True when every rank finishes; false on a deadlock (no rank can move).
bool simulate_blocking(const Orders& o, int kept) {
  const size_t n = o.where.size();
  std::vector<char> sent(n, 0), posted(n, 0);  // by the producing op's index
  std::vector<size_t> pc(static_cast<size_t>(o.p), 0);
  std::vector<int> phase(static_cast<size_t>(o.p), 0);  // 0: take the input; 1: wait on sends
  std::vector<std::vector<std::vector<size_t>>> flight(o.p, std::vector<std::vector<size_t>>(2));
  auto input_of = [&](int s, size_t k, size_t* in) {
    return k < o.ops[s].size() && o.producer(o.ops[s][k], s, in) && o.where[*in].rank != s;
  };
  for (;;) {
    bool moved = false, all = true;
    for (int s = 0; s < o.p; ++s) {
      const size_t end = o.ops[s].size();
      if (pc[s] == end && phase[s] == 0) continue;
      all = false;
      if (phase[s] == 0) {
        size_t in = 0;
        if (input_of(s, pc[s], &in)) {
          posted[in] = 1;
          if (!sent[in]) continue;
        }
        const PipelineOp& op = o.ops[s][pc[s]];
        const size_t self = o.index(op, s);
        // Its consumer on another rank: the next chunk's forward, the previous chunk's backward.
        const int g = o.global(op, s);
        const bool sends = op.kind == Kind::kForward ? g < o.p * o.v - 1 && o.p > 1 : g > 0 && o.p > 1;
        if (sends) {
          sent[self] = 1;
          flight[s][op.kind == Kind::kForward ? 0 : 1].push_back(self);
        }
        phase[s] = 1;
        moved = true;
      }
      bool blocked = false;
      for (auto& q : flight[s]) {
        const size_t allowed = pc[s] + 1 == end ? 0 : static_cast<size_t>(kept);
        while (q.size() > allowed && posted[q.front()]) q.erase(q.begin());
        if (q.size() > allowed) blocked = true;
      }
      if (!blocked) {
        size_t in2 = 0;
        if (input_of(s, pc[s] + 1, &in2)) posted[in2] = 1;
        ++pc[s];
        phase[s] = 0;
        moved = true;
      }
    }
    if (all) return true;
    if (!moved) return false;
  }
}

}  // namespace interleaved

TEST(InterleavedOneFOneB, EveryForwardBeforeItsBackwardAndProducersFirst) {
  for (int p = 1; p <= 4; ++p)
    for (int v = 1; v <= 4; ++v)
      for (int m : {1, p, 2 * p, 3 * p}) {
        if (m < 1) continue;
        SCOPED_TRACE(::testing::Message() << "p " << p << " v " << v << " m " << m);
        const interleaved::Orders o(p, m, v);
        std::vector<int> seen(o.where.size(), 0);
        for (int s = 0; s < p; ++s) {
          ASSERT_EQ(o.ops[s].size(), static_cast<size_t>(2 * m * v));
          std::vector<int> next_f(v, 0), next_b(v, 0);
          for (size_t k = 0; k < o.ops[s].size(); ++k) {
            const PipelineOp& op = o.ops[s][k];
            ASSERT_TRUE(op.chunk >= 0 && op.chunk < v && op.micro_batch >= 0 && op.micro_batch < m);
            ++seen[o.index(op, s)];
            // Each (chunk, micro-batch) stream is in micro-batch order (the boundary's matching).
            std::vector<int>& next = op.kind == Kind::kForward ? next_f : next_b;
            EXPECT_EQ(op.micro_batch, next[op.chunk]++);
            if (op.kind == Kind::kBackward) {
              const interleaved::Place f = o.where[o.index(Kind::kForward, o.global(op, s), op.micro_batch)];
              EXPECT_LT(f.at, k) << "backward before its forward";
            }
            // A producer on the same rank runs earlier in its order.
            size_t in = 0;
            if (o.producer(op, s, &in) && o.where[in].rank == s) {
              EXPECT_LT(o.where[in].at, k);
            }
          }
        }
        for (int c : seen) EXPECT_EQ(c, 1) << "an op missing or repeated";
        // Warm-up forwards, then in flight: at most the warm-up plus one (all of them when
        // every forward runs first).
        for (int s = 0; s < p; ++s) {
          const int warmup = interleaved_warmup(p, s, m, v);
          for (int k = 0; k < warmup; ++k) EXPECT_EQ(o.ops[s][k].kind, Kind::kForward);
          if (warmup < m * v) {
            EXPECT_EQ(o.ops[s][warmup + 1].kind, Kind::kBackward);
          }
          EXPECT_EQ(max_in_flight(o.ops[s]), std::min(warmup + 1, m * v)) << "rank " << s;
        }
      }
}

TEST(InterleavedOneFOneB, MegatronOrderAndWarmUp) {
  // p = 2, v = 2, m = 4, rank 0: warm-up (2 - 0 - 1) 2 + (2 - 1) 2 = 4 forwards: chunk 0 of
  // micro-batches 0, 1, chunk 1 of 0, 1; then F(c0, 2) B(c1, 0) F(c0, 3) B(c1, 1) F(c1, 2)
  // B(c0, 0) F(c1, 3) B(c0, 1); then B(c1, 2) B(c1, 3) B(c0, 2) B(c0, 3).
  using K = Kind;
  const std::vector<PipelineOp> want = {
      {K::kForward, 0, 0},  {K::kForward, 1, 0},  {K::kForward, 0, 1},  {K::kForward, 1, 1},
      {K::kForward, 2, 0},  {K::kBackward, 0, 1}, {K::kForward, 3, 0},  {K::kBackward, 1, 1},
      {K::kForward, 2, 1},  {K::kBackward, 0, 0}, {K::kForward, 3, 1},  {K::kBackward, 1, 0},
      {K::kBackward, 2, 1}, {K::kBackward, 3, 1}, {K::kBackward, 2, 0}, {K::kBackward, 3, 0}};
  EXPECT_EQ(interleaved_one_f_one_b(2, 0, 4, 2), want);
  EXPECT_EQ(interleaved_warmup(2, 1, 4, 2), 2);
  EXPECT_EQ(interleaved_warmup(4, 0, 8, 2), 10);
  EXPECT_EQ(interleaved_warmup(4, 3, 8, 2), 4);
  EXPECT_EQ(interleaved_warmup(4, 3, 2, 2), 4) << "m < p: every forward first";
  // Rank 0's activations in flight: (2 (p-1) + (v-1) p + 1) chunks of L / (p v) layers, that
  // is 1 + (p - 1) / (p v) times 1F1B's p micro-batches of L / p layers.
  EXPECT_EQ(max_in_flight(interleaved_one_f_one_b(4, 0, 8, 2)), 2 * 3 + 4 + 1);
}

TEST(InterleavedOneFOneB, EveryRankFinishesWithTheInterleavedBubble) {
  for (int p = 1; p <= 5; ++p)
    for (int v = 1; v <= 4; ++v)
      for (int m = p; m <= 3 * p; m += p) {
        const interleaved::Orders o(p, m, v);
        // 2 m v chunk slots of work and 2 (p - 1) of bubble per rank.
        EXPECT_EQ(interleaved::simulate_slots(o), 2 * (m * v + p - 1)) << "p " << p << " v " << v << " m " << m;
      }
  EXPECT_DOUBLE_EQ(pipeline_bubble(4, 8, 1), 3.0 / 11);
  EXPECT_DOUBLE_EQ(pipeline_bubble(4, 8, 2), 3.0 / 19);
}

TEST(InterleavedOneFOneB, NoDeadlockWithTheBoundarysBlockingPoints) {
  for (int p = 1; p <= 5; ++p)
    for (int v = 1; v <= 4; ++v)
      for (int m : {1, p, 2 * p, 3 * p, 4 * p, 6 * p}) {
        const interleaved::Orders o(p, m, v);
        // The boundary keeps p sends per direction before it waits on the oldest.
        for (int kept : {1, 2, p})
          EXPECT_TRUE(interleaved::simulate_blocking(o, kept)) << "p " << p << " v " << v << " m " << m << " kept "
                                                                << kept;
      }
  // The simulation can fail: waiting on each send at once (none kept) deadlocks (pp=2: both
  // ranks wait on a send the other receives only after its own send).
  EXPECT_FALSE(interleaved::simulate_blocking(interleaved::Orders(2, 4, 2), 0));
  EXPECT_FALSE(interleaved::simulate_blocking(interleaved::Orders(4, 8, 1), 0));
}

// ---- ZB-H1: the backward split into B (input gradient) and W (weight gradient) ----

TEST(ZeroBubbleH1, EveryOpOnceInOrderAndOneFOneBsForwardsAndBackwards) {
  for (int p = 1; p <= 5; ++p)
    for (int m = 1; m <= 9; ++m)
      for (int s = 0; s < p; ++s) {
        SCOPED_TRACE(::testing::Message() << "p " << p << " s " << s << " m " << m);
        const std::vector<PipelineOp> ops = zero_bubble_h1(p, s, m);
        ASSERT_EQ(ops.size(), static_cast<size_t>(3 * m));
        int next[3] = {0, 0, 0};
        std::vector<PipelineOp> forward_backward;
        for (const PipelineOp& op : ops) {
          const int k = static_cast<int>(op.kind);
          EXPECT_EQ(op.micro_batch, next[k]++) << "each kind in micro-batch order, each op once";
          EXPECT_EQ(op.chunk, 0);
          if (op.kind == Kind::kBackward) {
            EXPECT_LT(op.micro_batch, next[0]) << "B before its F";
          }
          if (op.kind == Kind::kWeight) {
            EXPECT_LT(op.micro_batch, next[1]) << "W before its B";
          }
          if (op.kind != Kind::kWeight) forward_backward.push_back(op);
        }
        // F and B in 1F1B's order: the boundary's messages and blocking points are 1F1B's.
        EXPECT_EQ(forward_backward, one_f_one_b(p, s, m));
        // 1F1B's saved state in flight, plus the W inputs of at most s + 1 micro-batches.
        EXPECT_EQ(max_in_flight(ops), std::min(p - s, m));
        EXPECT_EQ(max_weight_pending(ops), std::min(s + 1, m));
      }
  using K = Kind;
  const std::vector<PipelineOp> first = {{K::kForward, 0}, {K::kForward, 1}, {K::kBackward, 0},
                                         {K::kWeight, 0},  {K::kBackward, 1}, {K::kWeight, 1}};
  const std::vector<PipelineOp> last = {{K::kForward, 0}, {K::kBackward, 0}, {K::kForward, 1},
                                        {K::kBackward, 1}, {K::kWeight, 0},  {K::kWeight, 1}};
  EXPECT_EQ(zero_bubble_h1(2, 0, 2), first);
  EXPECT_EQ(zero_bubble_h1(2, 1, 2), last);
}

// Every stage's order with op times F, B, W (1F1B's backward: B + W, the two fused): an op
// starts when its stage is free and its input is done (F(i): F(i) of s-1; B(i): B(i) of s+1,
// the last stage's its own F(i); W(i): B(i) of the stage). The time to finish, or -1 on a
// deadlock.
int64_t simulate_timed(int p, int m, bool zb, int64_t F, int64_t B, int64_t W) {
  std::vector<std::vector<PipelineOp>> order(static_cast<size_t>(p));
  for (int s = 0; s < p; ++s) order[s] = zb ? zero_bubble_h1(p, s, m) : one_f_one_b(p, s, m);
  // done[kind][s][i]: finish time, -1 before.
  std::vector<std::vector<std::vector<int64_t>>> done(3, std::vector<std::vector<int64_t>>(p, std::vector<int64_t>(m, -1)));
  std::vector<int64_t> free_at(static_cast<size_t>(p), 0);
  std::vector<size_t> pc(static_cast<size_t>(p), 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (int s = 0; s < p; ++s)
      while (pc[s] < order[s].size()) {
        const PipelineOp op = order[s][pc[s]];
        const int i = op.micro_batch;
        int64_t ready = 0;
        if (op.kind == Kind::kForward) ready = s == 0 ? 0 : done[0][s - 1][i];
        else if (op.kind == Kind::kBackward) ready = s == p - 1 ? done[0][s][i] : done[1][s + 1][i];
        else ready = done[1][s][i];
        if (ready < 0) break;
        const int64_t length = op.kind == Kind::kForward ? F : op.kind == Kind::kWeight ? W : zb ? B : B + W;
        free_at[s] = std::max(free_at[s], ready) + length;
        done[static_cast<int>(op.kind)][s][i] = free_at[s];
        ++pc[s];
        moved = true;
      }
  }
  for (int s = 0; s < p; ++s)
    if (pc[s] != order[s].size()) return -1;
  return *std::max_element(free_at.begin(), free_at.end());
}

TEST(ZeroBubbleH1, TheBubbleIsPMinusOneTimesFPlusBMinusW) {
  for (int p = 1; p <= 6; ++p)
    for (int m = p; m <= 3 * p; ++m) {
      SCOPED_TRACE(::testing::Message() << "p " << p << " m " << m);
      // Unit times: 3m slots of work and p - 1 idle slots per stage (1F1B: 3 (p - 1)).
      EXPECT_EQ(simulate_timed(p, m, true, 1, 1, 1), 3 * m + p - 1);
      EXPECT_EQ(simulate_timed(p, m, false, 1, 1, 1), 3 * (m + p - 1));
      for (const auto& [F, B, W] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
               {2, 2, 1}, {2, 3, 1}, {3, 3, 2}, {2, 2, 2}, {4, 5, 3}}) {
        EXPECT_EQ(simulate_timed(p, m, true, F, B, W), m * (F + B + W) + (p - 1) * (F + B - W))
            << "F " << F << " B " << B << " W " << W;
        EXPECT_EQ(simulate_timed(p, m, false, F, B, W), (m + p - 1) * (F + B + W));
      }
    }
  EXPECT_DOUBLE_EQ(zero_bubble_fraction(4, 8), 3.0 / 27);
  EXPECT_LT(zero_bubble_fraction(4, 8), pipeline_bubble(4, 8, 1));
}

TEST(ZeroBubbleH1, NoDeadlockWithTheBoundarysBlockingPoints) {
  // W moves nothing: the receive posted after an op is the next F's or B's (pipeline_model.cc),
  // so the boundary sees each rank's order less its W ops.
  for (int p = 1; p <= 5; ++p)
    for (int m : {1, p, 2 * p, 3 * p, 4 * p, 6 * p}) {
      std::vector<std::vector<PipelineOp>> ops(static_cast<size_t>(p));
      for (int s = 0; s < p; ++s)
        for (const PipelineOp& op : zero_bubble_h1(p, s, m))
          if (op.kind != Kind::kWeight) ops[s].push_back(op);
      const interleaved::Orders o(p, m, std::move(ops));
      for (int kept : {1, 2, p})
        EXPECT_TRUE(interleaved::simulate_blocking(o, kept)) << "p " << p << " m " << m << " kept " << kept;
    }
}

}  // namespace
}  // namespace foldpar
