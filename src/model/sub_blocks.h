// The sub-blocks of a Llama decoder block, each a forward, a backward and a saved-state
// struct over weight views and the rows of a BlockContext, with no communication. The
// single-rank block (llama_block.cc) is their composition; a parallel strategy calls them on
// its shard (a slice of heads, a column chunk of the MLP) and adds the communication around.
// The pre-norm is its own sub-block: TSP normalizes its rows once and then projects D x
// buckets head slices, and runs D MLP column chunks, over the one normed activation.
// Backward writes: a d_input passed undefined is allocated and written, a defined one is
// accumulated (+=); weight gradients are scaled by
// `g_beta` before the add (1: accumulate into the gradient, 0: write a fresh partial, as a
// TSP ring step does). Forward outputs y are scaled by `y_beta` likewise (1: y += ..., the
// residual; 0: y = ..., a Megatron rank's row-parallel partial summed over tp afterwards).
#pragma once

#include <functional>
#include <vector>

#include "backend/backend.h"
#include "model/llama_config.h"

namespace foldpar {

struct MoeAux;  // model/moe_layer.h
class WeightGradQueue;  // model/weight_grad_queue.h

// The per-step constants every block of a forward shares. T = batch * seq rows, batch-major.
struct BlockContext {
  const LlamaConfig* config = nullptr;
  Backend* backend = nullptr;
  int64_t batch = 0;                   // B
  int64_t seq = 0;                     // S (rows per batch entry; S/D under TSP)
  const Tensor* positions = nullptr;   // i32 [S], global positions of the rows
  const Tensor* rope_table = nullptr;  // [S, 2, d/2] from build_rope_table(positions)
  MoeAux* moe_aux = nullptr;           // MoE layers record their routing statistics here (null: not kept)
  // [sparse layers][E] the aux loss's gradient on the router probabilities (null: none)
  const std::vector<std::vector<double>>* moe_prob_grad = nullptr;
  // Set: the backwards queue their weight-gradient products here instead of running them
  // (a zero-bubble pipeline stage's B; the queue runs them as its W). Null: run at once.
  WeightGradQueue* weight_grads = nullptr;
  int64_t rows() const { return batch * seq; }
};

// A linear layer y = x W^T over a weight view: W as Hugging Face stores it [out, in], or its
// transpose [in, out] (TSP packs o_proj and down_proj so that a shard's columns are rows).
// An optional bias b [out] is added to every row (undefined: none).
struct LinearView {
  Tensor w;                 // [out, in], or [in, out] when transposed
  bool transposed = false;
  Tensor b{};               // [out] or undefined
};
// What a strategy adds to a sub-block's backward; the defaults are the single-rank block's.
struct BackwardSchedule {
  // Where an undefined d_input is allocated: with the activations, or as a communication
  // buffer by a strategy that sends it (Megatron's column-parallel dX before f's adjoint).
  MemCategory d_input_category = MemCategory::kActivations;
  // Runs once d_input is complete, before the weight gradients read the input `a`: a
  // strategy starts d_input's reduction there and finishes gathering `a`.
  std::function<void()> input_done;
  // Runs between the weight-gradient GEMMs (MPI moves transfers only inside MPI calls).
  std::function<void()> between;
};

// y = x W^T (+ b) + beta y. x: [T, in], y: [T, out].
void linear_forward(Backend& be, const LinearView& w, const Tensor& x, Tensor& y, float beta);
// dx = dy W + beta dx. dy: [T, out], dx: [T, in].
void linear_backward_input(Backend& be, const LinearView& w, const Tensor& dy, Tensor& dx, float beta);
// g = dy^T x + beta g, in g's storage (g.transposed: x^T dy); g.b (when defined) = the column
// sums of dy + beta g.b. dy: [T, out], x: [T, in]. With ctx.weight_grads the product is
// queued there (the bias's column sums run now).
void linear_backward_weight(const BlockContext& ctx, LinearView& g, const Tensor& dy, const Tensor& x, float beta);

// ---- pre-norm: a = rmsnorm(x) * gain (before attention, before the MLP, before the head) ----
struct NormSaved {
  Tensor x;     // [T, h] input (the residual stream)
  Tensor rstd;  // [T]
  Tensor a;     // [T, h] normed
};
NormSaved norm_forward(const BlockContext& ctx, const Tensor& gain, const Tensor& x);
// d_a: [T, h]. Returns dx [T, h] = norm^T(d_a) (+ *d_residual when given, the gradient that
// reaches x around the sub-block); g_gain += the gain's gradient of these rows.
Tensor norm_backward(const BlockContext& ctx, const Tensor& gain, const NormSaved& s, const Tensor& d_a,
                     const Tensor* d_residual, Tensor& g_gain);

// ---- attention input: q, k, v of a slice of heads (n_q query, n_k KV heads), RoPE on q, k ----
// The optional parts (undefined: absent) are the Hugging Face variants: q/k/v biases (Qwen2,
// Llama's attention_bias) and Qwen3's per-head RMSNorm of q and k (gains [d] shared by every
// head, eps rms_norm_eps) between the projection and RoPE:
//   q = rope(norm_d(a Wq^T + bq) * q_norm), k likewise, v = a Wv^T + bv.
struct QkvWeights {
  Tensor wq;  // [n_q*d, h]
  Tensor wk;  // [n_k*d, h]
  Tensor wv;  // [n_k*d, h]
  Tensor bq{}, bk{}, bv{};      // [n_q*d], [n_k*d], [n_k*d] or undefined
  Tensor q_norm{}, k_norm{};  // [d] or undefined
};
struct QkvSaved {
  Tensor q;  // [B, S, n_q, d] after RoPE
  Tensor k;  // [B, S, n_k, d] after RoPE
  Tensor v;  // [B, S, n_k, d]
  // With q/k norms: the projections before the norm and the per-head-row statistics.
  Tensor q_raw{}, k_raw{};    // [B, S, n, d]
  Tensor q_rstd{}, k_rstd{};  // [T * n]
};
// a: [T, h] the normed input. k and v come first: `kv_ready`, when set, runs with them
// (k after RoPE) before the q projection, so that a strategy's K/V exchange overlaps it.
QkvSaved qkv_forward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a,
                     const std::function<void(const Tensor& k, const Tensor& v)>& kv_ready = {});
// The query side: dq [B, S, n_q, d] (rotated back in place, then through the q norm when
// there is one); d_a (+)= dq Wq, g.wq (g.bq, g.q_norm). `saved` (qkv_forward's) is needed
// only with q/k norms.
void q_backward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a, Tensor& dq, Tensor& d_a,
                QkvWeights& g, float g_beta, const QkvSaved* saved = nullptr);
// The key/value side: dk (rotated back in place), dv [B, S, n_k, d]; d_a += dk Wk + dv Wv.
void kv_backward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a, Tensor& dk, const Tensor& dv,
                 Tensor& d_a, QkvWeights& g, float g_beta, const QkvSaved* saved = nullptr);
// Both sides at once, every input-gradient GEMM before the weight gradients (the same sums
// as q_backward then kv_backward): d_a (+)= dq Wq + dk Wk + dv Wv, then sched.input_done,
// then g.wq, g.wk, g.wv (sched.between between them). dq, dk rotated back in place.
struct QkvGrads {
  Tensor* dq;        // [B, S, n_q, d]
  Tensor* dk;        // [B, S, n_k, d]
  const Tensor* dv;  // [B, S, n_k, d]
};
void qkv_backward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a, const QkvGrads& d, Tensor& d_a,
                  QkvWeights& g, float g_beta, const BackwardSchedule& sched = {}, const QkvSaved* saved = nullptr);

// ---- attention output: y += attn Wo^T (+ bo) (y starts as the residual, a copy of the input) ----
// attn: [B, S, n_q, d]; wo: [h, n_q*d] (or transposed); y: [T, h] = attn Wo^T + y_beta y.
void attn_output_forward(const BlockContext& ctx, const LinearView& wo, const Tensor& attn, Tensor& y,
                         float y_beta = 1.0f);
// dy: [T, h]. Returns d_attn [B, S, n_q, d]; g_wo = dy^T attn + g_beta g_wo; `between`, when
// set, runs between the two GEMMs.
Tensor attn_output_backward(const BlockContext& ctx, const LinearView& wo, const Tensor& attn, const Tensor& dy,
                            LinearView& g_wo, float g_beta, const std::function<void()>& between = {});

// y = copy of x: [T, h], the residual a sub-block's output accumulates onto.
Tensor residual_forward(const BlockContext& ctx, const Tensor& x);

// ---- gated MLP on a column chunk: y += (silu(a Wg^T) * (a Wu^T)) Wd^T over f_c columns ----
// The whole MLP is the chunk f_c = f; TSP's ring runs D chunks of f/D into one y.
struct MlpWeights {
  Tensor w_gate;    // [f_c, h]  rows of gate_proj
  Tensor w_up;      // [f_c, h]  rows of up_proj
  LinearView down;  // [h, f_c] columns of down_proj (or transposed [f_c, h]); down.b [h] (mlp_bias)
  Tensor b_gate{}, b_up{};  // [f_c] the chunk's gate_proj and up_proj biases (mlp_bias), or undefined
};
struct MlpSaved {
  Tensor gate;  // [T, f_c]
  Tensor up;    // [T, f_c]
  Tensor act;   // [T, f_c] silu(gate) * up
};
// a: [T, h] normed input; y: [T, h] = ... + y_beta y. `between_gemms`, when set, runs between
// the gate and up projections (a strategy advances its in-flight transfers there).
void mlp_forward(const BlockContext& ctx, const MlpWeights& w, const Tensor& a, Tensor& y, MlpSaved* saved,
                 const std::function<void()>& between_gemms = {}, float y_beta = 1.0f);
// dy: [T, h]. d_a (+)= the input gradient [T, h]; g (views like w) = ... + g_beta g.
void mlp_backward(const BlockContext& ctx, const MlpWeights& w, const MlpSaved& s, const Tensor& a,
                  const Tensor& dy, Tensor& d_a, MlpWeights& g, float g_beta);
// mlp_backward in two halves, for a strategy that reduces d_a while the weight half
// computes. The input half: d_act = dy Wd (sched.between), g.down, SwiGLU's adjoint, d_a;
// returns d_gate, d_up [T, f_c], which the weight half reads (the caller holds them).
struct MlpInputGrads {
  Tensor d_gate, d_up;  // [T, f_c]
};
MlpInputGrads mlp_backward_input(const BlockContext& ctx, const MlpWeights& w, const MlpSaved& s, const Tensor& dy,
                                 Tensor& d_a, MlpWeights& g, float g_beta, const BackwardSchedule& sched = {});
// The weight half: g.w_gate, g.w_up from `a` [T, h] (sched.between between them).
void mlp_backward_weight(const BlockContext& ctx, const MlpInputGrads& d, const Tensor& a, MlpWeights& g,
                         float g_beta, const BackwardSchedule& sched = {});

}  // namespace foldpar
