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

StepResult step_forward_backward(ModelStep& step, int64_t layers, Recompute recompute) {
  const bool keep = recompute == Recompute::kNone;
  std::vector<Tensor> inputs(static_cast<size_t>(layers));  // kBlock: each block's input [T, h]
  Tensor x = step.embed_forward();
  for (int64_t l = 0; l < layers; ++l) {
    if (!keep) inputs[l] = x;
    x = step.block_forward(l, x, keep);
  }
  StepResult result = step.head_forward(x, true);
  x = Tensor();
  Tensor dx = step.head_backward(result);
  for (int64_t l = layers; l-- > 0;) {
    if (!keep) step.block_forward(l, inputs[l], true);  // the output is dropped at once
    dx = step.block_backward(l, std::move(dx));
    inputs[l] = Tensor();
  }
  step.embed_backward(dx);
  return result;
}

}  // namespace foldpar
