// StageStrategy: what a model-axis strategy (tsp/) gives a pipeline stage (pipeline/): the
// stage's micro-batches as ModelSteps (model/step_order.h) over the stage's weights, so the
// pipeline schedule drives the strategy's own embedding, blocks and head (global layer
// indices) without knowing how they shard or communicate. The pipeline owns the weights
// (ShardedWeights of its StageLayers) and the order; the strategy owns the math and its
// axis's collectives. Strategy folders implement it; pipeline/ never includes them.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "core/status.h"
#include "model/step_order.h"
#include "parallel/sharded_weights.h"

namespace foldpar {

// The micro-batches of one pipeline step on one stage, in flight together.
class StageSteps {
 public:
  virtual ~StageSteps() = default;
  // The ModelStep of one micro-batch: local [B, S_local] rows of this rank (local_batch);
  // its head's gradient is that of loss_sum / loss_normalizer (0: the micro-batch's own
  // valid tokens). Each holds its own saved state, so several may be in flight; they share
  // the step's accumulators. invalid_argument for a batch that does not fit the strategy.
  virtual Result<std::unique_ptr<ModelStep>> micro_batch(const Batch& local, int64_t loss_normalizer) = 0;
  // After a micro-batch's backward (its step's last call): the sums that close it (Megatron
  // with sequence parallelism: its norm gains over tp). Collective over the strategy's axes.
  virtual void finish_micro_batch(ModelStep& /*step*/) {}
  // After the last micro-batch's backward: the sums over the strategy's axis that close a
  // step (TSP: the norm gains of this stage's layers). Collective over that axis.
  virtual void finish_backward() = 0;
  // Seconds blocked on the strategy's own communication so far.
  virtual double wait_seconds() const = 0;
};

class StageStrategy {
 public:
  virtual ~StageStrategy() = default;
  // This rank's rows of a global batch (as ShardedModel::local_batch).
  virtual Batch local_batch(const Batch& global) const = 0;
  // Shard sizes on the strategy's weight axis.
  virtual const ShardDims& dims() const = 0;
  // The weight axis (assembly), whether this rank speaks for the replicated norm gains and
  // for its weight slices (ParamRef::counted; false on replicas over another model axis).
  virtual Communicator& weight_axis() = 0;
  virtual bool counts_replicated() const = 0;
  virtual bool counts_sharded() const { return true; }
  // A MoE model whose experts spread wider than the weight axis (Megatron stages: over the
  // tp x sp group): this rank's place on that expert axis (ShardedWeights::expert_rank; -1:
  // the weight axis itself) and the axis across weight-axis groups whose ranks hold the other
  // experts, over which assembly also sums the routed experts' tensors (null: none).
  virtual int expert_rank() const { return -1; }
  virtual Communicator* expert_across() { return nullptr; }
  // Experts over dp replicas (Layout::ep = K G, K > 1): the stage's dp/K replicas holding
  // this rank's experts, over which their gradients sum (ShardedModel::expert_data_axis); null
  // otherwise. And the communicators split off the world for the stage's expert groups
  // (ShardedModel::communicators_beside_mesh).
  virtual Communicator* expert_data_axis() { return nullptr; }
  virtual std::vector<const Communicator*> communicators_beside_mesh() const { return {}; }
  // Verification: this rank's logits rows [B, S_local, V] (keep_logits) placed into the full
  // [B, S, V] on every rank of the weight axis, as ShardedModel::assemble_logits.
  virtual Status assemble_logits(const Tensor& local, Tensor& global) = 0;
  // A step of micro-batches of `batch` sequences each over `weights`; `grads` null for a
  // forward only. Both must outlive the result.
  virtual std::unique_ptr<StageSteps> begin(Backend& backend, const ShardedWeights& weights, ShardedGrads* grads,
                                            int64_t batch) = 0;
};

}  // namespace foldpar
