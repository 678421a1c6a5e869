// ShardedModel: a Llama model under one parallel layout, as the layers above (verify,
// train, bench) see it, whatever the strategy (tsp, tp, sp, tp x sp). It owns this rank's
// weights and gradients. Every method that communicates is collective over the layout's
// model communicators: all ranks call it in the same order with the same arguments.
//
// Strategies implement it in their own folders (tsp/, megatron/); make_layout.h builds
// the one a layout string names. What strategies share (sharded weights, sequence shards,
// mappings) lives in parallel/ beside them.
#pragma once

#include <string>

#include "backend/backend.h"
#include "core/status.h"
#include "layout/layout.h"
#include "model/llama_model.h"
#include "parallel/param_ref.h"
#include "parallel/sequence_shard.h"

namespace foldpar {

class ShardedModel {
 public:
  virtual ~ShardedModel() = default;

  // "tsp=4", "tp=2,sp=2", ...
  virtual const std::string& layout() const = 0;

  // This rank's rows [B, S_local] of a global batch [B, S] (all rows where tokens are not
  // sharded). Not collective.
  virtual Batch local_batch(const Batch& global) const = 0;

  // Weights from the counter-based generator (model/llama_weights.h): the same values as
  // the single-rank model's, each rank generating only what it holds. Not collective.
  virtual void init_weights(const InitOptions& options) = 0;
  virtual void zero_grads() = 0;

  // One micro-batch; gradients accumulate (+=). The reported loss is the mean over the
  // valid tokens of this micro-batch across the model axes. The gradient is that of
  // loss_sum / loss_normalizer: pass the valid-token count of the whole global batch (all
  // micro-batches, all data-parallel replicas) so that accumulated gradients are those of
  // the global mean; 0 means this micro-batch's own count.
  virtual Result<StepResult> forward_backward(Backend& backend, const Batch& local, int64_t loss_normalizer) = 0;
  virtual Result<StepResult> forward(Backend& backend, const Batch& local) = 0;

  // The parameters this rank holds with their gradients, for the optimizer, clipping and
  // checkpoints (parallel/param_ref.h). Handles share storage with the model's tensors.
  virtual std::vector<ParamRef> parameters() = 0;

  // Full tensors on every rank, assembled from every rank's part (verification, dumps,
  // checkpoints; moves the whole model). `global` is allocated by the caller.
  virtual Status assemble_weights(LlamaWeights& global) = 0;
  virtual Status assemble_grads(LlamaWeights& global) = 0;
  // This rank's logits rows [B, S_local, V] (keep_logits) placed into the full [B, S, V]
  // on every rank.
  virtual Status assemble_logits(const Tensor& local, Tensor& global) = 0;
};

}  // namespace foldpar
