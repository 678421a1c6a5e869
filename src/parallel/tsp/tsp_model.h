// TspModel: the Llama model under Tensor-and-Sequence Parallelism on one axis of D ranks
// (docs/tsp.md sections 3-5). Every rank holds 1/D of the weights (ShardedWeights) and 1/D of
// the tokens (SequenceShard); weight shards travel to the tokens: attention shards by one
// broadcast each (plus an all-gather of K/V), MLP, embedding and LM-head shards around a
// ring. Outputs accumulate locally; no activation all-reduce. The backward is the adjoint
// schedule; after it every rank holds the complete gradient of its own shards.
//
// Collective over the TSP communicator: every rank calls forward/forward_backward with the
// same batch size and options, in the same order.
#pragma once

#include <cstdint>

#include "comm/communicator.h"
#include "model/llama_model.h"
#include "parallel/kv_cache.h"
#include "parallel/sequence_shard.h"
#include "parallel/sharded_weights.h"

namespace foldpar {

class TspModel {
 public:
  // The TSP model of rank `rank` of a tsp=D layout (layout.strategy kTsp, D = layout.tsp) at
  // sequence length `seq`: validate_layout's verdict first (invalid_argument naming the
  // numbers), nothing allocated before it. Not collective.
  static Result<TspModel> create(const LlamaConfig& config, const Layout& layout, int rank, int64_t seq);

  const LlamaConfig& config() const { return config_; }
  const ShardDims& dims() const { return dims_; }
  const SequenceShard& shard() const { return shard_; }
  // The global logits [B, S, V] on every rank from each rank's rows: placed by the sequence
  // split, then summed over the axis. Collective over tsp.
  Status assemble_logits(Communicator& tsp, const Tensor& local, Tensor& global) const;
  const Layout& options() const { return options_; }
  // Experts over dp replicas (Layout::ep = K D, K > 1): the expert group the all-to-all
  // dispatch runs over (rank k D + the tsp rank) and the dp/K replicas holding the same
  // experts, over which the routing statistics summed over the group sum again (instead of
  // data_axis). Both null (the default): the experts spread over the tsp axis. Must outlive
  // the model's steps. The group has the model's expert degree of ranks, this one at its tsp
  // rank modulo D (make_layout.cc builds it so; checked).
  void set_expert_axes(const Communicator& tsp, Communicator* group, Communicator* expert_data);
  Communicator* expert_group() const { return expert_group_; }
  Communicator* expert_data() const { return expert_data_; }

  // Loss (mean over the valid tokens of the whole global batch) of this rank's rows
  // local_batch [B, S/D] (SequenceShard::local_batch of the global batch).
  // data_axis (a MoE model under dp=R, else null): the replicas whose routing statistics the
  // aux loss also sums (TspStep::sum_moe_stats), so it is the global batch's; one more
  // all-reduce of 2E+1 f64 per sparse layer, collective over data_axis too.
  Result<StepResult> forward(Backend& backend, Communicator& tsp, const ShardedWeights& weights,
                             const Batch& local_batch, Communicator* data_axis = nullptr) const;
  // Forward and backward; the gradients of this rank's shards (summed over the axis) are
  // accumulated (+=) into `grads`, replicated norm gains included.
  // loss_normalizer: see ShardedModel::forward_backward (0: this batch's valid tokens, over
  // the data_axis replicas too for a MoE model). A MoE model refuses any other normalizer
  // (gradient accumulation would change its aux loss). Seven parameters: the two axes and
  // the normalizer say how this call relates to the step, the rest what it computes.
  Result<StepResult> forward_backward(Backend& backend, Communicator& tsp, const ShardedWeights& weights,
                                      const Batch& local_batch, ShardedWeights& grads,
                                      int64_t loss_normalizer = 0, Communicator* data_axis = nullptr) const;

  // Generation's prefill (docs/tsp.md section 6): the forward of the embedding and every block over
  // this rank's tokens local_ids i32 [B, S/D] (SequenceShard::local_batch), without the head.
  // Each layer's K (after RoPE) and V of this rank's tokens, every KV head, go into `cache`
  // (KvCache::store_prefill; keep_prefill_rows picks the rows it keeps), so the cache ends
  // sharded by sequence. Returns the last block's output [B*S/D, h] (before the final norm);
  // adds the time blocked on communication to *exposed_comm_seconds when given.
  // Traffic: the forward's, less the LM-head ring. Collective over the TSP communicator.
  Result<Tensor> prefill(Backend& backend, Communicator& tsp, const ShardedWeights& weights, const Tensor& local_ids,
                         KvCache& cache, double* exposed_comm_seconds = nullptr) const;
  // A pipeline stage's part of the prefill (parallel/pipeline/pipeline_decoder.h): the
  // embedding of local_ids when stage.embed, else from x [B*S/D, h] (the previous stage's
  // output; local_ids still gives B), then layers [stage.first, stage.end) into `cache`.
  // Returns [B*S/D, h]. Collective over the TSP communicator.
  Result<Tensor> prefill_stage(Backend& backend, Communicator& tsp, const ShardedWeights& weights,
                               const Tensor& local_ids, const StageLayers& stage, Tensor x, KvCache& cache,
                               double* exposed_comm_seconds = nullptr) const;

 private:
  TspModel(const LlamaConfig& config, ShardDims dims, SequenceShard shard, const Layout& options)
      : config_(config), dims_(dims), shard_(std::move(shard)), options_(options) {}

  LlamaConfig config_;
  ShardDims dims_;
  SequenceShard shard_;
  Communicator* expert_group_ = nullptr;
  Communicator* expert_data_ = nullptr;
  Layout options_;  // tsp=D and the knobs it reads: split, overlap, keep_weights, keep_kv,
                    // head_buckets, recompute, dtype, keep_logits
};

}  // namespace foldpar
