// The single-rank model (model/llama_model.h) as a ShardedModel: mixture-of-experts models
// train, checkpoint and resume on one rank through it (make_layout.cc picks it for a MoE
// config on a layout of one rank; tsp=D runs them through parallel/tsp/tsp_moe.cc). No
// communication; the full Hugging Face tensors are this rank's parameters.
#pragma once

#include <memory>

#include "parallel/sharded_model.h"

namespace foldpar {

// layout: validated, every degree 1; the weights are stored in layout.dtype (f32 or bf16: then
// run it on a bf16 storage backend), the gradients in f32. Its forward_backward takes the whole step's batch
// (loss_normalizer 0 or that batch's valid-token count): the aux loss of a MoE model is
// Hugging Face's over one batch, which gradient accumulation would change.
Result<std::unique_ptr<ShardedModel>> make_single_rank_model(const LlamaConfig& config, const Layout& layout);

}  // namespace foldpar
