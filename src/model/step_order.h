// The order of one training step, written once: embed, every block, head and loss; then the
// head's backward, every block in reverse (rerunning a block's forward first under
// Recompute::kBlock) and the embedding's backward. A strategy implements ModelStep for the
// parts that differ (its sharding and communication); the single-rank model is one
// implementation (llama_model.cc), TSP another (parallel/tsp/tsp_model.cc).
#pragma once

#include <cstdint>
#include <vector>

#include "model/llama_model.h"

namespace foldpar {

class WeightGradQueue;  // model/weight_grad_queue.h

// One step's parts on this rank. Each holds its own saved state between forward and backward.
class ModelStep {
 public:
  virtual ~ModelStep() = default;
  // x [T, h], the embedded rows of this rank.
  virtual Tensor embed_forward() = 0;
  // x_out [T, h] from x [T, h]; with `save`, keeps what block_backward(layer) needs.
  virtual Tensor block_forward(int64_t layer, const Tensor& x, bool save) = 0;
  // The loss of the last block's output x [T, h]; with `save`, keeps what head_backward needs.
  virtual StepResult head_forward(const Tensor& x, bool save) = 0;
  // d x_last [T, h] from the loss of `result`; releases the head's saved state.
  virtual Tensor head_backward(const StepResult& result) = 0;
  // dx_in [T, h] from dx_out [T, h], handed over so that it can be freed inside once used;
  // releases the layer's saved state.
  virtual Tensor block_backward(int64_t layer, Tensor dx) = 0;
  virtual void embed_backward(const Tensor& dx) = 0;
  // A zero-bubble pipeline stage's split backward (parallel/pipeline/): while `queue` is set,
  // block_backward leaves its weight-gradient products in it (model/weight_grad_queue.h) and
  // computes only the input gradient, the norm gains' and the biases' gradients; the caller
  // runs the queue later. Null: run them again. False, and nothing changes, where this
  // step's weight gradients cannot wait (they travel or are summed during its backward).
  virtual bool defer_weight_grads(WeightGradQueue* queue) { return queue == nullptr; }

  // A MoE model's aux loss under pp (parallel/pipeline/): a product of routing statistics
  // over every sparse layer, so no stage knows it alone. The statistics travel with the
  // micro-batch. routing_stats(): what this rank's rows recorded so far, the layers of the
  // stages before included (MoeAux::pack; empty for a dense model: nothing travels);
  // set_routing_stats(): the previous chunk's, before this chunk's blocks (they overwrite
  // only their own layers' rows). After head_forward (the last stage) or
  // set_aux_prob_grad (the others), aux_prob_grad() is the aux loss's gradient on the router
  // probabilities of every sparse layer (MoeAux::flatten; empty: none), which the blocks'
  // backward reads; set_aux_prob_grad() hands it to the stages before.
  virtual std::vector<double> routing_stats() const { return {}; }
  virtual void set_routing_stats(const std::vector<double>& /*stats*/) {}
  virtual std::vector<double> aux_prob_grad() const { return {}; }
  virtual void set_aux_prob_grad(const std::vector<double>& /*g*/) {}
};

// A pipeline stage's part of the order (parallel/pipeline/): the forward of blocks
// [first, end) from x for a backward later, saving each block's state (kNone) or only its
// input into inputs[l] (kBlock; `inputs` has a slot per model layer); and the backward of
// the same blocks in reverse from dx, rerunning each block's forward first under kBlock.
// step_forward_backward is these two around the embedding and the head.
Tensor forward_blocks_saving(ModelStep& step, int64_t first, int64_t end, Tensor x, Recompute recompute,
                             std::vector<Tensor>& inputs);
Tensor backward_blocks(ModelStep& step, int64_t first, int64_t end, Tensor dx, Recompute recompute,
                       std::vector<Tensor>& inputs);

// The forward of blocks 0..layers-1 from x, keeping nothing.
Tensor forward_blocks(ModelStep& step, int64_t layers, Tensor x);
// Embed, blocks, head: the loss only.
StepResult step_forward(ModelStep& step, int64_t layers);
// The forward and the backward in reverse; under Recompute::kBlock only each block's input
// is kept and the block's forward runs again just before its backward.
StepResult step_forward_backward(ModelStep& step, int64_t layers, Recompute recompute);

}  // namespace foldpar
