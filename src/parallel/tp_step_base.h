// The tensor-parallel half of one training or inference step, shared by the strategies that
// shard weights over a tp axis: plain TP (parallel/tp) and the TP x SP mesh (parallel/tpsp).
// Both run Megatron's blocks on some token rows: every token in TP, one sp shard's tokens
// under TP x SP. What is the same lives here once:
//   - the row mappings f/g and their sequence-parallel forms f'/g' (over the tp communicator),
//   - the vocabulary-parallel embedding, final norm, LM head and loss (over tp),
//   - the whole MLP sub-block, forward and backward,
//   - the attention sub-block's row-parallel output projection and the backward of its
//     column-parallel q/k/v projections and norm,
//   - the order of a step: embedding, L blocks, head, then the adjoint in reverse, with
//     Recompute::kBlock reruns.
// What differs stays in the strategy: the attention core (local in TP; a K/V exchange over
// sp under TP x SP), the positions, and where the norm gains' gradients go (norm_grad).
// Strategy state (weights, options) lives in the strategy's model; this class holds the
// state of ONE step and is made afresh per step.
//
// Row counts: N = B * tp_seq the token rows the column- and row-parallel GEMMs see; R the
// rows of this rank's residual stream (N, or N/tp with sequence parallelism). Allocation
// order matters: src/plan replays it (plan_validation_test holds the two together).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "model/llama_model.h"
#include "parallel/sharded_weights.h"
#include "parallel/tensor_parallel.h"

namespace foldpar::tp_detail {

// What the attention sub-block keeps for backward.
struct AttnSaved {
  Tensor x_in, rstd, a1;   // [R, h], [R], [R, h]: the norm region (1/tp with sequence parallel)
  Tensor a1_full;          // [N, h] the gathered a1, kept only by a recompute rerun (else undefined)
  Tensor q, k, v;          // [B, tp_seq, heads, d], [B, tp_seq, kv_heads, d]: local heads, after RoPE
  Tensor attn, lse;        // [B, tp_seq, heads, d], [B, heads, tp_seq]
  Tensor k_full, v_full;   // TP x SP's all-gather exchange: [B, S, kv_heads, d], kept only by a rerun
};

// What the MLP sub-block keeps for backward.
struct MlpSaved {
  Tensor x_mid, rstd, a2;  // [R, h], [R], [R, h]
  Tensor a2_full;          // [N, h], as a1_full
  Tensor gate, up, act;    // [N, f/tp]
};

struct LayerSaved {
  AttnSaved attn;
  MlpSaved mlp;
};

struct HeadSaved {
  Tensor x_last, rstd;     // [R, h], [R]
  Tensor xf_full;          // [N, h] the final norm's output on every row, kept for the head's weight gradient
  VocabParallelLoss loss;  // local logits [N, V/tp], lse [N]
};

// Where a step's rows come from.
struct TpRows {
  int64_t batch = 0;      // B
  int64_t tp_seq = 0;     // positions per sequence the tp GEMMs see: S (TP), S/sp (TP x SP)
  int64_t local_seq = 0;  // positions per sequence of the residual stream: tp_seq, or tp_seq/tp (sequence parallel)
};

class TpStepBase {
 public:
  virtual ~TpStepBase() = default;
  TpStepBase(const TpStepBase&) = delete;
  TpStepBase& operator=(const TpStepBase&) = delete;

  // x [R, h] from the vocabulary shards: local rows, then g (all_reduce) or g'.
  Tensor embed(const ShardedWeights& w);
  // bwd: g^T (identity, or all_gather) and a scatter into this rank's vocabulary rows.
  void embed_backward(const Tensor& dx, ShardedWeights& grads);

  // x [R, h] -> x_mid = x + attention(norm(x)). Fills `saved` when given; keep_gathered (a
  // recompute rerun, which backward follows at once) also keeps what it gathered.
  virtual Tensor attention_forward(int layer, const ShardedWeights& w, const Tensor& x, AttnSaved* saved,
                                   bool keep_gathered) = 0;
  // d(x_mid) [R, h] -> d(x) [R, h]; the layer's gradients += into grads. Releases what it
  // takes from `s`.
  virtual Tensor attention_backward(int layer, const ShardedWeights& w, AttnSaved& s, const Tensor& d_out,
                                    ShardedWeights& grads) = 0;
  // x_mid [R, h] -> x_out = x_mid + mlp(norm(x_mid)): [f] silu(a2 Wg_t^T) * (a2 Wu_t^T),
  // [g] the row-parallel down projection.
  Tensor mlp_forward(int layer, const ShardedWeights& w, const Tensor& x_mid, MlpSaved* saved, bool keep_gathered);
  Tensor mlp_backward(int layer, const ShardedWeights& w, const MlpSaved& s, const Tensor& d_out,
                      ShardedWeights& grads);

  // Final norm (f' with sequence parallelism), LM head and the vocabulary-parallel loss over
  // tp. With `logits` also this rank's rows [B, local_seq, V] (verification). The loss of
  // these rows.
  virtual StepResult head_forward(const ShardedWeights& w, const Tensor& x, HeadSaved& saved, Tensor* logits);
  // d(x_last) [R, h] of loss_sum / normalizer: the partial d_xf through f^T while the LM
  // head's weight gradient computes.
  Tensor head_backward(const ShardedWeights& w, HeadSaved& s, int64_t normalizer, ShardedWeights& grads);

  // Seconds this rank spent blocked in communication.
  virtual double blocked_seconds() const { return tp_.blocked_seconds(); }

 protected:
  // With sequence parallelism gathers every row's ids and targets over tp (one all_gather,
  // packed). FP_CHECKs that `tp` is the model's tp axis (degree, rank).
  TpStepBase(const LlamaConfig& config, const ShardDims& dims, Backend& backend, Communicator& tp, int tp_rank,
             bool overlap, bool sequence_parallel, TpRows rows, const Batch& local);

  Tensor act(const Shape& shape) const { return Tensor::empty(shape, DType::kF32, MemCategory::kActivations); }
  Tensor comm_buffer(const Shape& shape) const { return Tensor::empty(shape, DType::kF32, MemCategory::kComm); }
  // [R, h] -> [N, h]: f' (all_gather over tp) with sequence parallelism; identity otherwise.
  Tensor gather_rows(const Tensor& local);
  TpComm::Pending start_gather_rows(const Tensor& local, Tensor& full);
  // A partial [N, h] -> its tp sum on this rank's rows [R, h]: g (all_reduce, in place) or
  // g' (reduce_scatter). Returns the result (the partial itself without sequence parallel).
  Tensor reduce_rows(Tensor& partial);
  TpComm::Pending start_reduce_rows(Tensor& partial, Tensor& out);
  // Where a norm gain's gradient goes (index: attn norms 0..L-1, mlp norms L..2L-1, the
  // final norm 2L): `grad` itself unless the strategy keeps partials elsewhere.
  virtual Tensor& norm_grad(Tensor& grad, int index);

  // The attention sub-block's end: y = g(attn Wo_t^T) (row-parallel), x += y; returns y.
  Tensor output_projection(const Tensor& attn, const Tensor& wo_t, const Tensor& x);
  // The attention backward's start, before the core's adjoint: dy = g^T(d_out), every
  // row's a1 (kept, or gathered again into *a1_full with *a1_req in flight) and
  // d_attn = dy Wo_t^T; dWo_t += attn^T dy. `between` runs between the two GEMMs (the
  // strategy pokes its own transfers). Returns d_attn [B, tp_seq, heads, d].
  template <class Between>
  Tensor output_projection_backward(int layer, const ShardedWeights& w, AttnSaved& s, const Tensor& d_out,
                                    ShardedWeights& grads, Tensor* a1_full, TpComm::Pending* a1_req, Between between);
  // The attention backward's end, after RoPE's adjoint: the column-parallel q, k, v
  // GEMMs' d_a1 through f^T while their weight gradients compute, then the norm's
  // backward: returns dx = d_out + norm^T(d_a1).
  Tensor qkv_backward(int layer, const ShardedWeights& w, const AttnSaved& s, const Tensor& dq, const Tensor& dk,
                      const Tensor& dv, const Tensor& a1_full, TpComm::Pending& a1_req, const Tensor& d_out,
                      ShardedWeights& grads);

  const LlamaConfig& c_;
  const ShardDims& dims_;
  Backend& be_;
  TpComm tp_;
  bool seq_par_;           // Megatron sequence parallelism inside the tp group
  int64_t batch_;          // B
  int64_t tp_seq_;         // positions per sequence the tp GEMMs see
  int64_t local_seq_;      // positions per sequence of the residual stream
  int64_t rows_;           // R
  int64_t all_rows_;       // N
  Tensor ids_, targets_;   // i32 [N]: every row's ids and targets
};

template <class Between>
Tensor TpStepBase::output_projection_backward(int layer, const ShardedWeights& w, AttnSaved& s, const Tensor& d_out,
                                              ShardedWeights& grads, Tensor* a1_full, TpComm::Pending* a1_req,
                                              Between between) {
  const int64_t h = dims_.h, d = dims_.d, hl = dims_.heads;
  const AttnPieces a = attn_pieces(dims_, w.attn[layer]);
  AttnPieces g = attn_pieces(dims_, grads.attn[layer]);
  const Tensor dy = gather_rows(d_out);  // bwd of g: identity; of g': all_gather
  // Every row's a1 for the weight gradients: at hand, kept by a rerun, or gathered again.
  *a1_full = seq_par_ ? s.a1_full : s.a1;
  s.a1_full = Tensor();
  if (!a1_full->defined()) {
    *a1_full = comm_buffer({all_rows_, h});
    *a1_req = start_gather_rows(s.a1, *a1_full);
  }
  // y = attn Wo_t (row-parallel): d_attn = dy Wo_t^T, dWo_t += attn^T dy. No communication.
  Tensor d_attn = act({batch_, tp_seq_, hl, d});
  Tensor d_attn2 = d_attn.reshape({all_rows_, hl * d});
  be_.matmul(dy, false, a.wo_t, true, d_attn2);
  tp_.progress(*a1_req);
  between();
  be_.matmul(s.attn.reshape({all_rows_, hl * d}), true, dy, false, g.wo_t, 1.0f, 1.0f);
  return d_attn;
}

// The order of one step on any TpStepBase. Every block's forward; `saved` receives per-layer
// activations (all of them, or only the block inputs under Recompute::kBlock).
Tensor run_tp_blocks(TpStepBase& step, Recompute recompute, const ShardedWeights& w, Tensor x,
                     std::vector<LayerSaved>* saved);
// Embedding, blocks, head; with `grads` also the adjoint in reverse into *grads (the head's
// scale 1 / loss_normalizer, or 1 / this batch's valid tokens when 0). keep_logits: the
// result carries this rank's logits [B, local_seq, V].
StepResult run_tp_step(TpStepBase& step, Recompute recompute, bool keep_logits, const ShardedWeights& w,
                       ShardedWeights* grads, int64_t loss_normalizer);

}  // namespace foldpar::tp_detail
