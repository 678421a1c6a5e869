// ShardedModel: a Llama model under one parallel layout, as the layers above (verify,
// train, bench) see it, whatever the strategy (tsp, tp, sp, tp x sp). It owns this rank's
// weights and gradients. Every method that communicates is collective over the layout's
// model communicators: all ranks call it in the same order with the same arguments.
//
// Strategies implement it in their own folders (tsp/, megatron/) on WeightShardedModel
// below, which owns the weights, the gradients and their assembly, so a strategy adds only
// its step; make_layout.h builds the one a layout string names. What strategies share
// (sharded weights, sequence shards, mappings) lives in parallel/ beside them.
#pragma once

#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "core/status.h"
#include "layout/layout.h"
#include "model/llama_model.h"
#include "parallel/param_ref.h"
#include "parallel/sequence_shard.h"
#include "parallel/sharded_weights.h"

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
  virtual void zero_grads(Backend& backend) = 0;

  // One micro-batch; gradients accumulate (+=). The reported loss is the mean over the
  // valid tokens of this micro-batch across the model axes. The gradient is that of
  // loss_sum / loss_normalizer: pass the valid-token count of the whole global batch (all
  // micro-batches, all data-parallel replicas) so that accumulated gradients are those of
  // the global mean; 0 means this micro-batch's own count.
  virtual Result<StepResult> forward_backward(Backend& backend, const Batch& local, int64_t loss_normalizer) = 0;
  virtual Result<StepResult> forward(Backend& backend, const Batch& local) = 0;
  // One optimizer step's micro-batches (gradient accumulation): the sum of forward_backward
  // over `locals` in order (loss_sum and valid_tokens added up, loss their ratio), which a
  // pipeline runs as one schedule (parallel/pipeline/: its m micro-batches in flight). MoE
  // models: expert_load summed over the micro-batches, aux_loss their mean weighted by each
  // one's valid tokens (the aux term loss_sum carries, docs/design.md "Mixture of experts").
  virtual Result<StepResult> forward_backward_micro_batches(Backend& backend, const std::vector<Batch>& locals,
                                                            int64_t loss_normalizer);

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

  // A MoE model whose expert groups span dp replicas (Layout::ep > the model group): the
  // dp/K replicas that hold this rank's routed experts, over which their gradients sum
  // (sum_grads_over_data_axis); null otherwise (every dp replica holds the same experts).
  virtual Communicator* expert_data_axis() { return nullptr; }
  // The communicators the model split off the world beside the mesh's axes (a MoE model's
  // expert groups: "ep", "edp", "ep_across"), for whoever counts traffic per axis.
  virtual std::vector<const Communicator*> communicators_beside_mesh() const { return {}; }
};

// Expert parallelism over dp (Layout::ep = K G, K > 1 dp replicas of the model group's G
// ranks), split off the world by make_layout.cc; every member null when K is 1.
struct ExpertDataAxes {
  std::unique_ptr<Communicator> group;   // the expert group, K G ranks: rank k G + the model-group rank
  std::unique_ptr<Communicator> across;  // the group's ranks holding this rank's weight-axis slices (assembly)
  std::unique_ptr<Communicator> data;    // the dp/K replicas holding this rank's experts (their gradients)
  std::vector<const Communicator*> all() const {
    if (!group) return {};
    return {group.get(), data.get(), across.get()};
  }
};

// The data-parallel part of one optimizer step: every parameter's gradient summed over `dp`
// in place, weight shards, replicated norm gains, the attention variants' biases and q/k
// gains, KV replicas (each copy already complete on its ranks sums with the same copies of
// the other replicas), MoE routers and shared experts alike. Each
// replica's gradient is of its loss_sum over the valid tokens of the whole global batch
// (ShardedModel::forward_backward's normalizer), so the sum is the gradient of the global
// mean. Collective over dp, f32, one all_reduce per parameter in `params` order; nothing is
// issued when dp is null or has one rank. expert_dp (ShardedModel::expert_data_axis, when
// the expert groups span dp replicas): the routed experts' gradients (ParamRef::routed_expert)
// sum over it instead, as only those replicas hold the same experts.
void sum_grads_over_data_axis(Communicator* dp, std::vector<ParamRef>& params, Communicator* expert_dp = nullptr);

// What every weight-sharded strategy (tsp/, megatron/) shares, as WeightShardedDecoder
// (parallel/decode_block.h) is for generation: this rank's ShardedWeights over the weight
// axis (its heads, MLP columns and vocabulary rows; norm gains replicated) and their
// gradients in one flat ShardedGrads; the counter-based initialization, the ParamRefs, and
// assembly over the weight axis (none issued when it has one rank: the rank holds every
// weight). A strategy adds its step: local_batch, forward, forward_backward, assemble_logits.
class WeightShardedModel : public ShardedModel {
 public:
  const std::string& layout() const final { return layout_; }
  void init_weights(const InitOptions& options) final { init_sharded_weights(options, weights_); }
  void zero_grads(Backend& backend) final { grads_.zero(backend); }
  std::vector<ParamRef> parameters() final;
  Communicator* expert_data_axis() final { return expert_dp_; }
  // Collective over the weight axis only: replicas on other axes assemble the same model.
  Status assemble_weights(LlamaWeights& global) final { return assemble(weights_, global); }
  Status assemble_grads(LlamaWeights& global) final { return assemble(grads_.views(), global); }

 protected:
  // Which of this rank's parameters the optimizer's norm and checkpoints count
  // (sharded_param_refs): one rank speaks for each replicated copy.
  struct Counting {
    bool replicated = true;  // the norm gains
    bool sharded = true;     // the weight slices (false on replicas of another axis's rank)
  };
  // layout: "tsp=4", "tp=2,sp=2", ...; dtype: the weights' storage (the gradients are f32).
  WeightShardedModel(const LlamaConfig& config, const ShardDims& dims, Communicator& weight_axis, std::string layout,
                     DType dtype, Counting counting);

  // Expert parallelism wider than the weight axis (the Megatron baselines' tp x sp expert
  // axis): this rank's place on it, and the axis across weight-axis groups (sp) whose ranks
  // hold the other experts, over which assembly also sums the routed experts' tensors.
  // expert_dp: the replicas holding the same experts when the expert axis spans dp replicas
  // (ExpertDataAxes::data; across then spans them too).
  void set_expert_axis(int expert_rank, Communicator* across, Communicator* expert_dp = nullptr) {
    weights_.expert_rank = expert_rank;
    grads_.views().expert_rank = expert_rank;
    expert_across_ = across;
    expert_dp_ = expert_dp;
  }

  ShardedWeights weights_;
  ShardedGrads grads_;

 private:
  Communicator* expert_across_ = nullptr;
  Communicator* expert_dp_ = nullptr;
  Status assemble(const ShardedWeights& shard, LlamaWeights& global);

  Communicator& weight_axis_;
  std::string layout_;
  Counting counting_;
};

}  // namespace foldpar
