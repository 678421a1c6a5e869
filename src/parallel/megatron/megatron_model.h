// MegatronModel: the Llama model under Megatron tensor parallelism inside each tp group of tp
// ranks and sequence (context) parallelism across sp groups: the layouts tp=<tp> (sp = 1),
// sp=<sp> (tp = 1) and the 2-D mesh tp=<tp>,sp=<sp> (docs/tsp.md sections 7-8, the TP, SP and
// TP x SP baselines) are this one strategy. Rank (t, p) holds the tp slices of rank t
// (ShardedWeights of degree tp: its heads, MLP columns and vocabulary rows; norm gains
// replicated; tp = 1: every weight), identical on every sp rank, and the S/sp positions of sp
// shard p (SequenceShard, zigzag by default; contiguous when sp = 1) of every sequence. The tp
// collectives (parallel/tensor_parallel.h) run over the tp communicator on those B*S/sp token
// rows; attention exchanges the K/V of the rank's tp-sharded KV heads over the sp
// communicator (parallel/kv_exchange.h, or parallel/ring_attention.h). With sequence
// parallelism (Megatron's, inside the tp group; tp > 1 only) the residual stream and the norms
// hold only a contiguous block of S/(sp tp) of the sp shard's local rows.
//
// An axis of one rank issues no collective: with tp = 1 the row mappings and the loss's
// reductions are local, with sp = 1 attention is local (no K/V exchange) and nothing is
// summed over sp, so tp=<tp> and sp=<sp> move exactly what a strategy without that axis would.
//
//   attention  a1 = norm(x); [f] q,k,v of the local heads on the S/sp local tokens; RoPE at
//              global positions; K/V over sp (all_gather, or the ring); causal attention of
//              the local queries; [g] x_mid = x + tp_sum(attn Wo_t^T)
//   MLP        [f] silu(a2 Wg_t^T) * (a2 Wu_t^T); [g] x_out = x_mid + tp_sum(act Wd_t^T)
//   conjugates f: identity / all_reduce(tp); g: all_reduce(tp) / identity; with sequence
//              parallelism f' = all_gather_seq / reduce_scatter_seq and g' the reverse;
//              K/V all_gather(sp) / reduce_scatter(sp); K/V ring / K/V ring + dK/dV ring.
//   gradients  sp > 1: every gradient and norm gain is partial over sp (each sp rank saw its
//              tokens): one packed all_reduce over sp of this step's partial at the end of
//              backward (MegatronGrads: one flat buffer); with sequence parallelism the norm
//              gains are also partial over tp: one all_reduce over tp of their packed region
//              first. sp = 1: the step accumulates into the gradients directly; with sequence
//              parallelism the gains' partials go to a packed buffer all_reduced over tp.
//   loss       the vocabulary-parallel cross-entropy over tp on the local rows; loss sum and
//              valid count all_reduced over sp: the mean over the whole global batch.
//
// Traffic per rank in elements (comm/comm_stats.h convention: sent = received; an all_reduce
// of x over M ranks moves 2 x (M-1)/M when M divides x, the ring-block rule otherwise). Notation:
// N = B*S/sp the sp shard's token rows, n = N*h, G(x) = x (tp-1)/tp, and
// KV = 2*B*S*h/(g tp) * (sp-1)/sp (the gathered K/V of the rank's tp-sharded heads):
//   per layer, forward     tp: all_reduce 4 G(n) in 2 calls | sequence parallel: all_gather
//                          2 G(n) + reduce_scatter 2 G(n) (2 calls each)
//                          sp: all_gather KV in 2B calls | ring: send_recv KV in sp-1 hops
//                          (docs/tsp.md section 7's TP x SP row: 4 G(n) + KV)
//   per layer, backward    tp: plain all_reduce 4 G(n) (dX of both column-parallel GEMMs, 2
//   (fb minus forward)     calls) | sequence parallel: all_gather 4 G(n) (dY of both sub-blocks,
//                          the norm outputs gathered again) + reduce_scatter 2 G(n), plus 2h
//                          more elements in the per-step tp all_reduce of the norm gains
//                          sp: all_gather KV again (2B calls) + reduce_scatter KV of dK/dV
//                          (2B calls) | ring: send_recv 2 KV (K/V ring again, dK/dV ring
//                          home; 2(sp-1) hops); plus attn+mlp shard elements + 2h more in the
//                          per-step sp all_reduce of the gradients
//   Recompute::kBlock      reruns each block forward in backward with its communication:
//                          adds one layer's forward; the all-gather exchange keeps the
//                          rerun's gathered K/V (no second gather), sequence parallelism the
//                          rerun's gathered norm outputs (no re-gather: all_gather 2 G(n) less)
//   once per step          tp: embedding all_reduce 2 G(n) | reduce_scatter G(n); the loss's
//                          all_reduce of N maxima and of 2N sums; backward, plain: all_reduce
//                          2 G(n) of d_xf; sequence parallel: all_gather G(2N) of the i32 ids
//                          and targets, all_gather G(n) of xf before the LM head, and in
//                          backward reduce_scatter G(n) of d_xf, all_gather G(n) of the
//                          embedding's dX and all_reduce of the (2L+1)h norm gains
//                          sp: all_reduce of 2 f64 (loss sum, valid count); backward: one
//                          all_reduce of every gradient this rank holds, L (attn + mlp shard
//                          elements) + (1 or 2) V/tp*h + (2L+1) h (chunks of 2^30 elements)
//   keep_logits            (verification) adds an all_gather over tp of the rows' [rows, V/tp]
//   KV replicas (n_kv < tp) per layer, backward: the KV group's (tp/n_kv ranks) Wk/Wv
//                          gradient partials of 2 d h f32 elements are summed point to point
//                          (sum_kv_replicas): the group's first rank receives tp/n_kv - 1 and
//                          sends as many sums back, the others send one and receive one; KV
//                          above counts the rank's one KV head (2 B S d (sp-1)/sp)
// On an axis of one rank every term of that axis is zero, calls included. Bytes: elements
// times the storage dtype's size (bf16 under :bf16: 2) for the rows, K/V, dK/dV, the ring's
// blocks and keep_logits; 4 for the loss's statistics and the gradients over sp, whatever
// the storage; 8 for the loss sums.
// tests/parallel/megatron_traffic_test.cc holds every term per communicator and kind.
//
// A MoE model (parallel/megatron/tp_moe.cc; docs/composition.md, "Expert parallelism on the
// Megatron baselines"): a sparse layer's experts spread over the tp x sp group (MegatronAxes::ep),
// E/(tp sp) per rank, its rows dispatched by the all-to-all of parallel/moe_dispatch.h; its
// traffic terms are written there. The routed experts' gradients stay out of the sum over sp.
//
// Collective over both communicators: every rank calls forward/forward_backward with the
// same batch size and options, in the same order.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "model/llama_model.h"
#include "parallel/kv_cache.h"
#include "parallel/sequence_shard.h"
#include "parallel/sharded_model.h"
#include "parallel/sharded_weights.h"

namespace foldpar {

// The two axes of the mesh: tp (tp ranks) inside, sp (sp ranks) across; either may be a
// communicator of one rank (comm/self_communicator.h) where the layout lacks the axis.
struct MegatronAxes {
  Communicator* tp = nullptr;
  Communicator* sp = nullptr;
  // A MoE model: the expert axis, the tp x sp group (rank sp * tp + t; tp or sp itself where
  // the other has one rank), and the dp replicas its routing statistics are summed over.
  Communicator* ep = nullptr;
  Communicator* dp = nullptr;
  // Where ep spans K dp replicas (Layout::ep): the dp/K replicas holding the same experts,
  // over which the statistics summed over ep are summed again (null otherwise).
  Communicator* expert_dp = nullptr;
};

class MegatronModel {
 public:
  // The model of the rank at (tp_rank, sp_rank) of a Megatron layout (tp=<tp>, sp=<sp>, either
  // possibly 1) at sequence length `seq`: validate_layout's verdict first (invalid_argument
  // naming the numbers), nothing allocated before it. bf16 storage (layout.dtype) keeps
  // weights, activations and what travels in bf16, per-row statistics and gradients f32
  // (the f32 masters are the optimizer's). Not collective. for_prefill: generation's model
  // (prefill below), whose MoE layers run replicated over tp, so validate_layout's sizes at
  // `seq` (a prompt's length, which need not divide by tp) are not asked.
  static Result<MegatronModel> create(const LlamaConfig& config, const Layout& layout, int tp_rank, int sp_rank,
                                      int64_t seq, bool for_prefill = false);

  const LlamaConfig& config() const { return config_; }
  const ShardDims& dims() const { return dims_; }
  const SequenceShard& shard() const { return shard_; }  // the sp shard
  const Layout& options() const { return options_; }
  int tp_rank() const { return tp_rank_; }
  int tp_degree() const { return dims_.degree; }
  int sp_degree() const { return shard_.degree(); }
  // Megatron sequence parallelism in the norm regions: the option, on a tp axis of more than
  // one rank (with one rank it would change nothing).
  bool sequence_parallel() const { return seq_par_; }
  // Positions per sequence the tp GEMMs see: S/sp.
  int64_t sp_seq() const { return shard_.local_seq(); }
  // Positions per sequence this rank's batch holds: S/sp, or S/(sp tp) with sequence parallelism.
  int64_t local_seq() const { return static_cast<int64_t>(positions_.size()); }
  // Global positions of this rank's rows, in local order.
  const std::vector<int32_t>& positions() const { return positions_; }

  // This rank's rows [B, local_seq] of a global batch [B, S]. Not collective.
  Batch local_batch(const Batch& global) const;
  // The global logits [B, S, V] on every rank from each rank's rows [B, local_seq, V]:
  // placed, then summed over tp (with sequence parallelism, where tp ranks hold different
  // rows) and sp. Collective over tp and sp.
  Status assemble_logits(Communicator& tp, Communicator& sp, const Tensor& local, Tensor& global) const;

  // Loss (mean over the valid tokens of the global batch, the same on every rank) of the
  // local batch. Collective over tp and sp.
  Result<StepResult> forward(Backend& backend, const MegatronAxes& axes, const ShardedWeights& weights,
                             const Batch& local) const;
  // Forward and backward: the gradient of loss_sum / loss_normalizer (0: this micro-batch's
  // global valid count), summed over sp (and the gains over tp), accumulated (+=) into grads
  // (ShardedGrads: one flat buffer, so that the sum over sp is one all_reduce) on every rank.
  // Collective over tp and sp.
  Result<StepResult> forward_backward(Backend& backend, const MegatronAxes& axes, const ShardedWeights& weights,
                                      const Batch& local, ShardedGrads& grads, int64_t loss_normalizer) const;

  // Generation's prefill (tp=<tp> only: sp = 1, no sequence parallelism, else
  // invalid_argument): the forward of the embedding and every block over every token of ids
  // i32 [B, S], without the head. Each layer's K (after RoPE) and V of this rank's KV heads,
  // every token, go into `cache` (KvCache::store_prefill), so the cache ends sharded by
  // heads. Returns the last block's output [B*S, h], the same on every rank (and adds the
  // time blocked on communication to *exposed_comm_seconds when given). Collective over tp.
  Result<Tensor> prefill(Backend& backend, const MegatronAxes& axes, const ShardedWeights& weights, const Tensor& ids,
                         KvCache& cache, double* exposed_comm_seconds = nullptr) const;
  // A pipeline stage's part of the prefill (parallel/pipeline/pipeline_decoder.h), under the
  // same conditions: the embedding of ids when stage.embed, else from x [B*S, h] (the
  // previous stage's output; ids still gives B and S), then layers [stage.first, stage.end)
  // into `cache`. Returns [B*S, h]. Collective over tp.
  Result<Tensor> prefill_stage(Backend& backend, const MegatronAxes& axes, const ShardedWeights& weights,
                               const Tensor& ids, const StageLayers& stage, Tensor x, KvCache& cache,
                               double* exposed_comm_seconds = nullptr) const;

 private:
  MegatronModel(const LlamaConfig& config, ShardDims dims, int tp_rank, SequenceShard shard,
                const Layout& options);

  LlamaConfig config_;
  ShardDims dims_;
  int tp_rank_;
  SequenceShard shard_;
  Layout options_;
  bool seq_par_;
  std::vector<int32_t> positions_;
};

}  // namespace foldpar
