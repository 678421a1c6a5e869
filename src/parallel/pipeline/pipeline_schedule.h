// The order in which one pipeline stage runs its micro-batches' forwards and backwards
// (docs/composition.md section 2). Pure arithmetic: no tensors, no communication.
//
// 1F1B: stage s of p runs min(p - s - 1, m) warm-up forwards, then alternates one forward
// and one backward, then drains the remaining backwards. Forwards and backwards each run in
// micro-batch order on every stage, so the messages between two stages, in each direction,
// are in micro-batch order too. Stage s holds at most p - s micro-batches' activations.
#pragma once

#include <vector>

namespace foldpar {

struct PipelineOp {
  enum class Kind { kForward, kBackward };
  Kind kind = Kind::kForward;
  int micro_batch = 0;

  bool operator==(const PipelineOp&) const = default;
};

// Stage s (0 <= s < p) of p with m >= 1 micro-batches: 2m ops, each micro-batch's forward
// before its backward.
std::vector<PipelineOp> one_f_one_b(int p, int s, int m);

// Micro-batches whose forward has run and whose backward has not, at most, over the order.
int max_in_flight(const std::vector<PipelineOp>& ops);

}  // namespace foldpar
