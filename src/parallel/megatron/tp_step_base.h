// The tensor-parallel half of one Megatron step (parallel/megatron/megatron_step.h adds the
// sequence axis): Megatron's blocks on some token rows, one sp shard's tokens (every token
// with one sp rank), as a ModelStep (model/step_order.h: the step order is the model's).
// The block math is model/'s sub-blocks (model/sub_blocks.h) on this rank's heads and MLP
// columns; this class adds the communication around them:
//   - the row mappings f/g and their sequence-parallel forms f'/g' (over the tp communicator;
//     nothing is issued when tp has one rank),
//   - the vocabulary-parallel embedding, final norm, LM head and loss (over tp),
//   - the MLP sub-block's mappings, forward and backward,
//   - the attention sub-block's row-parallel output projection and the backward of its
//     column-parallel q/k/v projections and norm.
// The attention core, the positions and where the norm gains' gradients go (norm_grad) are
// the subclass's. This class holds the state of ONE step and is made afresh per step.
//
// Rows: N = B * tp_seq, the tp group's token rows, which the column- and row-parallel GEMMs
// see; R = B * local_seq, this rank's rows of the residual stream and the norms (N, or N/tp
// with sequence parallelism).
//
// Storage (as the single-rank model and TSP): activations, their gradients, the row-parallel
// partials and everything that travels over tp and sp (rows, K/V, dK/dV) in the layout's
// dtype (bf16 under :bf16, so the collectives move 2-byte elements, reduced in f32 by the
// communicator and rounded once); per-row statistics (rstd, lse, the loss's maxima and sums)
// and the weights' gradients always f32. The plan's replay (plan/tpsp_memory.cc) follows every
// allocation here (tests/parallel/plan_validation_test holds the two together).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "model/moe_layer.h"
#include "model/step_order.h"
#include "model/sub_blocks.h"
#include "parallel/moe_dispatch.h"
#include "parallel/sharded_weights.h"
#include "parallel/tensor_parallel.h"

namespace foldpar::megatron_detail {

// What the attention sub-block keeps for backward.
struct AttnSaved {
  NormSaved norm;          // x_in [R, h], rstd [R], a1 [R, h]: the norm region
  Tensor a1_full;          // [N, h] the gathered a1, kept only by a recompute rerun (else undefined)
  QkvSaved qkv;            // q [B, tp_seq, heads, d], k, v [B, tp_seq, kv_heads, d]: local heads, after RoPE
  Tensor attn, lse;        // [B, tp_seq, heads, d], [B, heads, tp_seq]
  Tensor k_full, v_full;   // the all-gather exchange over sp: [B, S, kv_heads, d], kept only by a rerun
};

// What the MLP sub-block keeps for backward.
struct TpMlpSaved {
  NormSaved norm;          // x_mid [R, h], rstd [R], a2 [R, h]
  Tensor a2_full;          // [N, h], as a1_full
  MlpSaved mlp;            // gate, up, act [N, f/tp]
  MoeShardSaved moe;       // a MoE model's sparse layer (tp_moe.cc): its norm.a holds this rank's share of a2
};

struct LayerSaved {
  AttnSaved attn;
  TpMlpSaved mlp;
};

struct HeadSaved {
  NormSaved norm;          // x_last [R, h], rstd [R]; xf itself only without sequence parallelism
  Tensor xf_full;          // [N, h] the final norm's output on every row, kept for the head's weight gradient
  VocabParallelLoss loss;  // local logits [N, V/tp], lse [N]
};

// Where a step's rows come from.
struct TpRows {
  int64_t batch = 0;      // B
  int64_t tp_seq = 0;     // positions per sequence the tp GEMMs see: S/sp
  int64_t local_seq = 0;  // positions per sequence of the residual stream: tp_seq, or tp_seq/tp (sequence parallel)
};

// What one step computes with: the weights, and for a training step the gradients.
struct TpStepInputs {
  const ShardedWeights* weights = nullptr;
  ShardedWeights* grads = nullptr;  // null: forward only
  int64_t loss_normalizer = 0;      // as in ShardedModel::forward_backward (0: this batch's valid tokens)
  bool keep_logits = false;         // the result carries this rank's logits [B, local_seq, V]
  bool recompute = false;           // Recompute::kBlock: a saving block forward is a rerun
};

class TpStepBase : public ModelStep {
 public:
  TpStepBase(const TpStepBase&) = delete;
  TpStepBase& operator=(const TpStepBase&) = delete;

  // ---- ModelStep ----
  // x [R, h] from the vocabulary shards: local rows, then g (all_reduce) or g'.
  Tensor embed_forward() override;
  // x [R, h] -> x_out: attention then MLP. With `save` under recompute (a rerun, which
  // backward follows at once) also keeps what the block gathered (norm outputs, K/V).
  Tensor block_forward(int64_t layer, const Tensor& x, bool save) override;
  // Final norm (f' with sequence parallelism), LM head and the vocabulary-parallel loss over
  // tp; the loss of these rows (the subclass sums it over sp). Always keeps its state.
  StepResult head_forward(const Tensor& x, bool save) override;
  // d(x_last) [R, h] of loss_sum / normalizer: the partial d_xf through f^T while the LM
  // head's weight gradient computes.
  Tensor head_backward(const StepResult& result) override;
  Tensor block_backward(int64_t layer, Tensor dx) override;
  // bwd of the embedding: g^T (identity, or all_gather) and a scatter into this rank's
  // vocabulary rows.
  void embed_backward(const Tensor& dx) override;
  // The zero-bubble split: every weight gradient of a block is this rank's own slice,
  // accumulated locally (the sp sum waits for the step's end), so its products can wait;
  // with KV replicas the wk/wv gradients' sum over the KV group is queued behind them. A MoE
  // model's expert gradients are summed by their dispatch during the backward: not split.
  bool defer_weight_grads(WeightGradQueue* queue) override;
  // A MoE model under pp (ModelStep's contract): this step's routing statistics, the stages'
  // before included, travel with its activation; the aux loss's gradient with its gradient.
  // Each micro-batch in flight is a step of its own, so each keeps its own.
  std::vector<double> routing_stats() const override {
    return c_.moe.enabled() ? moe_stats_.pack() : std::vector<double>{};
  }
  void set_routing_stats(const std::vector<double>& stats) override { moe_stats_.unpack(stats); }
  std::vector<double> aux_prob_grad() const override { return MoeAux::flatten(moe_prob_grad_); }
  void set_aux_prob_grad(const std::vector<double>& g) override { moe_prob_grad_ = moe_stats_.unflatten(g); }

  // A MoE model: the communicator of its expert axis (the tp x sp group, rank sp * tp + t).
  void set_expert_axis(Communicator* ep) { ep_ = ep; }

  // Seconds this rank spent blocked in communication.
  double blocked_seconds() const { return tp_.blocked_seconds(); }

 protected:
  // With sequence parallelism gathers every row's ids and targets over tp (one all_gather,
  // packed). FP_CHECKs that `tp` is the model's tp axis (degree, rank).
  // dtype: the storage of the weights and activations (Layout::dtype).
  TpStepBase(const LlamaConfig& config, const ShardDims& dims, Backend& backend, Communicator& tp, int tp_rank,
             bool overlap, bool sequence_parallel, DType dtype, TpRows rows, const Batch& local, TpStepInputs in);
  // The positions and RoPE table of the rows the GEMMs see, once the subclass has them.
  void set_positions(const Tensor* positions, const Tensor* rope_table);

  // x [R, h] -> x_mid = x + attention(norm(x)). Fills `saved` when given; keep_gathered (a
  // recompute rerun) also keeps what it gathered.
  virtual Tensor attention_forward(int layer, const Tensor& x, AttnSaved* saved, bool keep_gathered) = 0;
  // d(x_mid) [R, h] -> d(x) [R, h]; the layer's gradients += into the step's gradients.
  // Releases what it takes from `s`.
  virtual Tensor attention_backward(int layer, AttnSaved& s, const Tensor& d_out) = 0;
  // x_mid [R, h] -> x_out = x_mid + mlp(norm(x_mid)): [f] the model's MLP on this rank's
  // f/tp columns, [g] the row-parallel down projection's sum.
  Tensor mlp_forward(int layer, const Tensor& x_mid, TpMlpSaved* saved, bool keep_gathered);
  Tensor mlp_backward(int layer, const TpMlpSaved& s, const Tensor& d_out);
  // A MoE model's sparse layer instead (tp_moe.cc): x_out = x_mid + moe(norm(x_mid)) with the
  // experts spread over the expert axis (set_expert_axis: the tp x sp group).
  Tensor moe_forward(int layer, const Tensor& x_mid, TpMlpSaved* saved);
  Tensor moe_backward(int layer, const TpMlpSaved& s, const Tensor& d_out);
  // The capacity limit on this rank's host expert ids [T, k] (its MoE rows: per sequence the
  // block [t n, (t+1) n) of its sp shard's positions, n = T / B, t its tp rank where the rows
  // are split over tp): the expert axis (the tp x sp group) all-gathers ids and positions,
  // and each rank drops as the single-rank model does on whole sequences.
  void drop_over_capacity(std::vector<int32_t>& ids, int64_t T, bool block_of_tp);
  // Generation's prefill (tp=N, sp 1, no sequence parallelism, forward only): every tp rank
  // routes every row, runs its own experts on the rows routed to them, and one all_reduce over
  // tp sums the experts' outputs (decode's MoE block, parallel/decode_block.cc), so prompt
  // lengths need not divide by tp.
  Tensor moe_forward_replicated(int layer, const Tensor& x_mid);
  // The step's routing statistics summed over the expert axis and, given `dp` (the replicas),
  // over it too with *valid_tokens: the single-rank model's on the global batch. expert_dp
  // (the expert axis spans K dp replicas): over the expert axis, then over expert_dp instead
  // of dp (together every model rank of every replica once).
  MoeAux sum_moe_stats(Communicator* dp, Communicator* expert_dp, int64_t* valid_tokens);
  void set_moe_prob_grad(std::vector<std::vector<double>> g) { moe_prob_grad_ = std::move(g); }

  // Activations and what travels in the storage dtype; per-row statistics always f32.
  Tensor act(const Shape& shape) const { return Tensor::empty(shape, dtype_, MemCategory::kActivations); }
  Tensor stat(const Shape& shape) const { return Tensor::empty(shape, DType::kF32, MemCategory::kActivations); }
  Tensor comm_buffer(const Shape& shape) const { return Tensor::empty(shape, dtype_, MemCategory::kComm); }
  // A row-parallel GEMM's partial [N, h]: in a communication buffer when g' reduce-scatters it.
  MemCategory partial_category() const { return seq_par_ ? MemCategory::kComm : MemCategory::kActivations; }
  Tensor row_partial() const { return Tensor::empty({all_rows_, dims_.h}, dtype_, partial_category()); }
  // [R, h] -> [N, h]: f' (all_gather over tp) with sequence parallelism; identity otherwise.
  Tensor gather_rows(const Tensor& local);
  TpComm::Pending start_gather_rows(const Tensor& local, Tensor& full);
  // A partial [N, h] -> its tp sum on this rank's rows [R, h]: g (all_reduce, in place; the
  // partial itself on one tp rank) or g' (reduce_scatter). Returns the result (the partial
  // itself without sequence parallel).
  Tensor reduce_rows(Tensor& partial);
  TpComm::Pending start_reduce_rows(Tensor& partial, Tensor& out);
  // Where a norm gain's gradient goes (index: attn norms 0..L-1, mlp norms L..2L-1, the
  // final norm 2L): `grad` itself unless the strategy keeps partials elsewhere.
  virtual Tensor& norm_grad(Tensor& grad, int index);

  // The attention sub-block's end: y = g(attn Wo_t^T) (row-parallel), x += y; returns y.
  Tensor output_projection(int layer, const Tensor& attn, const Tensor& x);
  // The attention backward's start, before the core's adjoint: dy = g^T(d_out), every
  // row's a1 (kept, or gathered again into *a1_full with *a1_req in flight) and
  // d_attn = dy Wo_t^T; dWo_t += attn^T dy. `between` runs between the two GEMMs (the
  // strategy pokes its own transfers). Returns d_attn [B, tp_seq, heads, d].
  Tensor output_projection_backward(int layer, AttnSaved& s, const Tensor& d_out, Tensor* a1_full,
                                    TpComm::Pending* a1_req, const std::function<void()>& between);
  // The attention backward's end, after the core's adjoint: the model's q/k/v backward
  // (RoPE's adjoint, the column-parallel GEMMs' d_a1 through f^T while their weight
  // gradients compute), then the norm's backward: returns dx = d_out + norm^T(d_a1).
  Tensor qkv_backward(int layer, const AttnSaved& s, const QkvGrads& d, const Tensor& a1_full,
                      TpComm::Pending& a1_req, const Tensor& d_out);

  // This rank's heads and MLP columns of layer l as the model's sub-block weights; qkv_view
  // of a whole ShardedWeights also attaches this rank's heads' q/k/v bias slices and the q/k
  // norm gains (attach_attn_variants), when the model has them.
  QkvWeights qkv_view(const Tensor& packed_attn) const;
  QkvWeights qkv_view(const ShardedWeights& w, int layer) const;
  LinearView wo_view(const Tensor& packed_attn) const;
  MlpWeights mlp_view(const Tensor& packed_mlp) const;
  // Layer l's MLP with Llama's mlp_bias, when the model has it: this rank's columns' gate/up
  // bias slices, and the down bias on tp rank 0 only (the sum over tp adds it once).
  MlpWeights mlp_biased_view(int l) const;

  const LlamaConfig& c_;
  const ShardDims& dims_;
  Backend& be_;
  TpComm tp_;
  bool seq_par_;           // Megatron sequence parallelism inside the tp group
  DType dtype_;            // storage of the weights and activations
  int64_t batch_;          // B
  int64_t tp_seq_;         // positions per sequence the tp GEMMs see
  int64_t local_seq_;      // positions per sequence of the residual stream
  int64_t rows_;           // R
  int64_t all_rows_;       // N
  Tensor ids_, targets_;   // i32 [N]: every row's ids and targets
  BlockContext ctx_;       // the N rows the GEMMs see (B, tp_seq), their positions and RoPE table
  BlockContext row_ctx_;   // the R rows of the norms (B, local_seq)
  const ShardedWeights& w_;
  TpStepInputs in_;
  // A training step's partial gradients of the q/k/v biases (this rank's heads' slices, the
  // rest zero) and the q/k norms (this rank's heads): summed over tp by sum_variant_grads.
  // The o bias's gradient needs no tp sum (every tp rank sees every row's dy) and goes to the
  // gradients directly.
  ShardedWeights variant_partials_;
  // Adds variant_partials_ summed over tp into `grads` (one all_reduce; nothing without
  // variants). Collective over tp.
  void sum_variant_grads(ShardedWeights& grads);

  Communicator* ep_ = nullptr;          // MoE: the expert axis
  bool moe_replicated_ = false;         // MoE: generation's prefill (moe_forward_replicated)
  MoeAux moe_stats_;                    // MoE: this rank's routing statistics per sparse layer
  std::vector<std::vector<double>> moe_prob_grad_;  // MoE: the aux loss's gradient per sparse layer

 private:
  std::vector<LayerSaved> saved_;  // per layer, training steps only
  HeadSaved hs_;
};

}  // namespace foldpar::megatron_detail
