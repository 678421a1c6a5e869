// TpModel: the Llama model under Megatron tensor parallelism on one axis of tp ranks. Every
// rank holds 1/tp of the weights (ShardedWeights: the heads, MLP columns and vocabulary rows
// of rank t, replicated norm gains) and every token of the micro-batch; with sequence
// parallelism the residual stream and the norms hold only the rank's contiguous block of
// S/tp positions of every sequence. Per block:
//
//   attention  a1 = norm(x); [f] q,k,v of the local heads (column-parallel); RoPE; causal
//              attention over all S positions; [g] x_mid = x + all_reduce(attn Wo_t^T)
//   MLP        a2 = norm(x_mid); [f] silu(a2 Wg_t^T) * (a2 Wu_t^T); [g] x_out = x_mid +
//              all_reduce(act Wd_t^T)
//   f = identity fwd / all_reduce of dX bwd; g = all_reduce fwd / identity bwd. With
//   sequence parallelism f' = all_gather(seq) fwd / reduce_scatter(seq) bwd and
//   g' = reduce_scatter(seq) fwd / all_gather(seq) bwd (parallel/tensor_parallel.h).
//
// Traffic per rank in elements, sent = received (comm/comm_stats.h convention), with
// n = B*S*h and G(x) = x (tp-1)/tp (an all_gather or reduce_scatter of x elements in all; an
// all_reduce of x moves 2 G(x)):
//   per layer, forward       plain: all_reduce 4 G(n)  (docs/tsp.md section 7's TP row)
//                            sequence-parallel: all_gather 2 G(n) + reduce_scatter 2 G(n)
//   per layer, backward      plain: all_reduce 4 G(n)  (the dX of both column-parallel GEMMs)
//   (fb minus forward)       sequence-parallel: all_gather 4 G(n) (dY of both sub-blocks, and
//                            the norm outputs gathered again for the weight gradients, as
//                            Megatron does), reduce_scatter 2 G(n) (dX), and 4 G(h) more in
//                            the one packed all_reduce of the norm gains' partials
//   Recompute::kBlock reruns each block forward in backward with its communication: plain
//   adds all_reduce 4 G(n); sequence-parallel adds all_gather 2 G(n) + reduce_scatter 2 G(n)
//   and keeps the rerun's gathered norm outputs, which saves the 2 G(n) re-gather.
//   once per step            embedding: all_reduce 2 G(n) | reduce_scatter G(n); loss: an
//                            all_reduce of B*S maxima, one of 2*B*S sums; backward, plain:
//                            all_reduce 2 G(n) of d_xf; sequence-parallel only: all_gather of
//                            the i32 ids and targets (G(2*B*S)), all_gather G(n) of xf before
//                            the LM head, reduce_scatter G(n) of d_xf, all_gather G(n) of the
//                            embedding's dX, the final norm's 2 G(h) in the packed all_reduce
//   keep_logits (verification) adds one all_gather of the local logits [B*S, V/tp].
// tests/parallel/tp_traffic_test.cc holds every term, per operation kind.
//
// Overlap: the forward's all-reduces sit on the critical path (Megatron's basic schedule);
// in backward the dX collective of each column-parallel GEMM runs while the weight-gradient
// GEMMs compute (the LM head's d_xf likewise), and the re-gather of the norm output runs
// during the attention / SwiGLU backward (LayoutOptions::overlap; off: every collective
// completes where it starts). Megatron's other overlaps (the forward's all-gather behind
// the previous GEMM, tp-comm-overlap) are not built.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "model/llama_model.h"
#include "parallel/kv_cache.h"
#include "parallel/sequence_shard.h"
#include "parallel/sharded_weights.h"

namespace foldpar {

struct TpOptions {
  // Megatron sequence parallelism: norms and residual stream sharded by contiguous sequence
  // blocks (needs S % tp == 0); all_gather / reduce_scatter replace the all-reduces.
  bool sequence_parallel = false;
  // Backward: run the dX collectives behind the weight-gradient GEMMs.
  bool overlap = true;
  Recompute recompute = Recompute::kNone;
  // Verification only: also return this rank's logits [B, S_local, V] (one extra all_gather
  // of the vocabulary shards, counted like every other transfer).
  bool keep_logits = false;
  // (Sequence parallelism always splits contiguously, as Megatron does: LayoutOptions::split
  // and the TSP policies do not apply.)
};

class TpModel {
 public:
  // Validates divisibility (heads, KV heads, f, V by tp; S by tp with sequence parallelism)
  // and returns invalid_argument naming the numbers otherwise. Not collective.
  static Result<TpModel> create(const LlamaConfig& config, int degree, int rank, int64_t seq,
                                const TpOptions& options);

  const LlamaConfig& config() const { return config_; }
  const ShardDims& dims() const { return dims_; }
  const TpOptions& options() const { return options_; }
  int rank() const { return rank_; }
  int64_t seq() const { return seq_; }  // S
  // Positions per sequence this rank's batch holds: S, or S/tp with sequence parallelism.
  int64_t local_seq() const { return options_.sequence_parallel ? seq_ / dims_.degree : seq_; }
  // The rank's rows of a global batch [B, S]: all of them, or with sequence parallelism
  // positions [t*S/tp, (t+1)*S/tp) of every sequence. Not collective.
  Batch local_batch(const Batch& global) const;
  // Places this rank's logits rows [B, S_local, V] into `global` [B, S, V] (other rows left).
  void scatter_rows(const Tensor& local, Tensor& global) const;

  // Loss (mean over the valid tokens of the global batch, the same on every rank) of the
  // local batch [B, S_local]. Collective over tp.
  Result<StepResult> forward(Backend& backend, Communicator& tp, const ShardedWeights& weights,
                             const Batch& local_batch) const;
  // Forward and backward; this rank's shard gradients (and the full norm-gain gradients)
  // are accumulated (+=) into `grads`. Collective over tp.
  Result<StepResult> forward_backward(Backend& backend, Communicator& tp, const ShardedWeights& weights,
                                      const Batch& local_batch, ShardedWeights& grads,
                                      int64_t loss_normalizer = 0) const;

  // Generation's prefill: the forward of the embedding and every block over every token of
  // ids i32 [B, S], without the head. Each layer's K (after RoPE) and V of this rank's KV
  // heads, every token, go into `cache` (KvCache::store_prefill), so the cache ends sharded by
  // heads. Returns the last block's output [B*S, h], the same on every rank (and adds the time
  // blocked on communication to *exposed_comm_seconds when given). Plain TP only
  // (invalid_argument with sequence parallelism). Collective over tp.
  Result<Tensor> prefill(Backend& backend, Communicator& tp, const ShardedWeights& weights, const Tensor& ids,
                         KvCache& cache, double* exposed_comm_seconds = nullptr) const;

 private:
  TpModel(const LlamaConfig& config, ShardDims dims, int rank, int64_t seq, const TpOptions& options)
      : config_(config), dims_(dims), rank_(rank), seq_(seq), options_(options) {}

  LlamaConfig config_;
  ShardDims dims_;
  int rank_;
  int64_t seq_;
  TpOptions options_;
};

}  // namespace foldpar
