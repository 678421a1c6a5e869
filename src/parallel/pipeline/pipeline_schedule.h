// The order in which one pipeline stage runs its micro-batches' forwards and backwards
// (docs/composition.md section 2). Pure arithmetic: no tensors, no communication.
//
// 1F1B: stage s of p runs min(p - s - 1, m) warm-up forwards, then alternates one forward
// and one backward, then drains the remaining backwards. Forwards and backwards each run in
// micro-batch order on every stage, so the messages between two stages, in each direction,
// are in micro-batch order too. Stage s holds at most p - s micro-batches' activations.
//
// Interleaved 1F1B (v chunks per rank; Megatron-LM's order): the L layers are cut into p v
// chunks, rank s holding global chunks s, s + p, ..., s + (v-1) p (its local chunks 0..v-1).
// The micro-batches go in groups of g = min(p, m) (m % g == 0): forward k (k = 0 .. m v - 1)
// is local chunk (k mod g v) / g of micro-batch (k / (g v)) g + k mod g, backward k the same
// with the chunk mirrored (v - 1 - chunk). Rank s runs min((p - s - 1) 2 + (v - 1) g, m v)
// warm-up forwards (all of them when m < p), then one forward and one backward alternately,
// then the remaining backwards. Each (chunk, micro-batch) stream is in micro-batch order.
// With unit-time chunk ops the step takes 2 (m v + p - 1) slots (m % p == 0): a bubble of
// (p - 1) / (m v + p - 1) of the step, against 1F1B's (p - 1) / (m + p - 1).
//
// Zero-bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): each backward is split
// into B, the input gradient through the stage (sent upstream at once), and W, the weight
// gradients of the stage's blocks (deferred). Stage s runs, for x = 0 .. m + p - 2, the ops
// F(x), B(x - (p-1-s)), W(x - (p-1)) that exist (index in [0, m)), in that order. F and B are
// in 1F1B's order (p-s-1 warm-up forwards, then alternating), so the boundary's messages and
// its blocking points are 1F1B's; stage s defers s + 1 W's at most, which fill the slots
// where 1F1B's stage waits for gradients in the drain. After F(x) stage s holds p - s
// micro-batches' whole saved state (1F1B's) and s micro-batches' W inputs only: stage 0
// holds exactly 1F1B's. With times F, B, W per op (W <= F, B) a step takes
// m (F + B + W) + (p - 1)(F + B - W) on every stage (1F1B, whose backward is B + W:
// (m + p - 1)(F + B + W)); with unit times 3m + p - 1 slots, a bubble of
// (p - 1) / (3m + p - 1) against 1F1B's 3 (p - 1) / (3 (m + p - 1)).
#pragma once

#include <vector>

namespace foldpar {

struct PipelineOp {
  // kBackward: the whole backward under 1F1B and interleaving, its input-gradient part B
  // under ZB-H1; kWeight: ZB-H1's weight-gradient part W (no communication).
  enum class Kind { kForward, kBackward, kWeight };
  Kind kind = Kind::kForward;
  int micro_batch = 0;
  int chunk = 0;  // the rank's local chunk (interleaved); 0 under 1F1B

  bool operator==(const PipelineOp&) const = default;
};

// Stage s (0 <= s < p) of p with m >= 1 micro-batches: 2m ops, each micro-batch's forward
// before its backward.
std::vector<PipelineOp> one_f_one_b(int p, int s, int m);

// Rank s of p with v >= 1 chunks and m >= 1 micro-batches, m % min(p, m) == 0 (FP_CHECK:
// validate_micro_batches refuses the rest first): 2 m v ops as above.
std::vector<PipelineOp> interleaved_one_f_one_b(int p, int s, int m, int v);

// The warm-up forwards of rank s under the interleaved order (before its first backward).
int interleaved_warmup(int p, int s, int m, int v);

// ZB-H1 for stage s (0 <= s < p) of p with m >= 1 micro-batches: 3m ops, each micro-batch's
// F before its B before its W; F and B in one_f_one_b's order.
std::vector<PipelineOp> zero_bubble_h1(int p, int s, int m);

// Micro-batches (or (chunk, micro-batch) pairs) whose forward has run and whose backward has
// not, at most, over the order (kWeight ops do not count: B releases the saved state).
int max_in_flight(const std::vector<PipelineOp>& ops);
// ZB-H1: micro-batches whose B has run and whose W has not, at most (stage s: min(s + 1, m)).
int max_weight_pending(const std::vector<PipelineOp>& ops);

// The idle fraction of a step with unit-time ops: (p - 1) / (m v + p - 1) (v = 1: 1F1B).
double pipeline_bubble(int p, int m, int v);
// ZB-H1's with unit-time F, B and W: (p - 1) / (3m + p - 1).
double zero_bubble_fraction(int p, int m);

}  // namespace foldpar
