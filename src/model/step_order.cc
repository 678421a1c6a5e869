// The step order shared by every ModelStep.
#include "model/step_order.h"

#include <utility>
#include <vector>

namespace foldpar {

Tensor forward_blocks(ModelStep& step, int64_t layers, Tensor x) {
  for (int64_t l = 0; l < layers; ++l) x = step.block_forward(l, x, false);
  return x;
}

StepResult step_forward(ModelStep& step, int64_t layers) {
  Tensor x = forward_blocks(step, layers, step.embed_forward());
  return step.head_forward(x, false);
}

Tensor forward_blocks_saving(ModelStep& step, int64_t first, int64_t end, Tensor x, Recompute recompute,
                             std::vector<Tensor>& inputs) {
  const bool keep = recompute == Recompute::kNone;
  for (int64_t l = first; l < end; ++l) {
    if (!keep) inputs[l] = x;
    x = step.block_forward(l, x, keep);
  }
  return x;
}

Tensor backward_blocks(ModelStep& step, int64_t first, int64_t end, Tensor dx, Recompute recompute,
                       std::vector<Tensor>& inputs) {
  const bool keep = recompute == Recompute::kNone;
  for (int64_t l = end; l-- > first;) {
    if (!keep) step.block_forward(l, inputs[l], true);  // the output is dropped at once
    dx = step.block_backward(l, std::move(dx));
    inputs[l] = Tensor();
  }
  return dx;
}

StepResult step_forward_backward(ModelStep& step, int64_t layers, Recompute recompute) {
  std::vector<Tensor> inputs(static_cast<size_t>(layers));  // kBlock: each block's input [T, h]
  Tensor x = forward_blocks_saving(step, 0, layers, step.embed_forward(), recompute, inputs);
  StepResult result = step.head_forward(x, true);
  x = Tensor();
  Tensor dx = backward_blocks(step, 0, layers, step.head_backward(result), recompute, inputs);
  step.embed_backward(dx);
  return result;
}

}  // namespace foldpar
