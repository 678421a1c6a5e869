// Sub-block forward and backward. Each backward mirrors its forward in reverse; every
// matmul's gradient pair is written next to it:
//   y = x W^T   =>   dx (+)= dy W,   dW += dy^T x.
#include "model/sub_blocks.h"

#include "backend/bf16_storage_backend.h"
#include "model/weight_grad_queue.h"

namespace foldpar {
namespace {

Tensor act_like(const Shape& shape, const Tensor& like) {
  return Tensor::empty(shape, like.dtype(), MemCategory::kActivations);
}

// Per-row statistics (rstd) stay f32 beside bf16 activations (backend/bf16_storage_backend.h).
Tensor stat_like(const Shape& shape, const Tensor& like) {
  return Tensor::empty(shape, stat_dtype(like.dtype()), MemCategory::kActivations);
}

// A d_input passed undefined is allocated here (in `category`) and written (beta 0); a
// defined one is added to.
float allocate_or_accumulate(Tensor& d, const Shape& shape, const Tensor& like,
                             MemCategory category = MemCategory::kActivations) {
  if (d.defined()) return 1.0f;
  d = Tensor::empty(shape, like.dtype(), category);
  return 0.0f;
}

void run(const std::function<void()>& hook) {
  if (hook) hook();
}

// A column of T ones: a bias add is the rank-1 product ones b^T, its gradient ones^T dy.
Tensor ones_column(Backend& be, int64_t rows, const Tensor& like) {
  Tensor ones = act_like({rows, 1}, like);
  be.fill(1.0, ones);
  return ones;
}

// y [T, out] += b [out] on every row.
void add_bias(Backend& be, const Tensor& b, Tensor& y) {
  const int64_t out = b.numel(), rows = y.numel() / out;
  Tensor y2 = y.reshape({rows, out});
  be.matmul(ones_column(be, rows, y), false, b.reshape({1, out}), false, y2, 1.0f, 1.0f);
}

// g_b [out] = the column sums of dy [T, out] + beta g_b.
void bias_grad(Backend& be, const Tensor& dy, Tensor& g_b, float beta) {
  const int64_t out = g_b.numel(), rows = dy.numel() / out;
  Tensor g2 = g_b.reshape({1, out});
  be.matmul(ones_column(be, rows, dy), true, dy.reshape({rows, out}), false, g2, 1.0f, beta);
}

// Per-head RMSNorm over the last axis d of x [B, S, n, d]: y = x / rms(x) * gain [d].
void head_norm_forward(const BlockContext& ctx, const Tensor& gain, const Tensor& x, Tensor& y, Tensor& rstd) {
  const int64_t d = gain.numel(), rows = x.numel() / d;
  Tensor y2 = y.reshape({rows, d});
  ctx.backend->rmsnorm_forward(x.reshape({rows, d}), gain, ctx.config->rms_norm_eps, y2, rstd);
}

// dy [B, S, n, d] (after RoPE's adjoint) -> the gradient before the norm; g_gain = its
// gradient + g_beta g_gain.
Tensor head_norm_backward(const BlockContext& ctx, const Tensor& gain, const Tensor& x, const Tensor& rstd,
                          const Tensor& dy, Tensor& g_gain, float g_beta) {
  Backend& be = *ctx.backend;
  const int64_t d = gain.numel(), rows = x.numel() / d;
  if (g_beta == 0.0f) be.fill(0.0, g_gain);
  else if (g_beta != 1.0f) be.scale_inplace(g_beta, g_gain);
  Tensor dx = act_like(dy.shape(), dy);
  Tensor dx2 = dx.reshape({rows, d});
  be.rmsnorm_backward(x.reshape({rows, d}), gain, rstd, dy.reshape({rows, d}), dx2, g_gain);
  return dx;
}

}  // namespace

void linear_forward(Backend& be, const LinearView& w, const Tensor& x, Tensor& y, float beta) {
  be.matmul(x, false, w.w, !w.transposed, y, 1.0f, beta);
  if (w.b.defined()) add_bias(be, w.b, y);
}

void linear_backward_input(Backend& be, const LinearView& w, const Tensor& dy, Tensor& dx, float beta) {
  be.matmul(dy, false, w.w, w.transposed, dx, 1.0f, beta);
}

namespace {

// c = a^T b + beta c (a weight gradient), now or queued as the context says.
void weight_gemm(const BlockContext& ctx, const Tensor& a, const Tensor& b, Tensor& c, float beta) {
  if (ctx.weight_grads != nullptr) ctx.weight_grads->push(a, true, b, false, c, beta);
  else ctx.backend->matmul(a, true, b, false, c, 1.0f, beta);
}

}  // namespace

void linear_backward_weight(const BlockContext& ctx, LinearView& g, const Tensor& dy, const Tensor& x, float beta) {
  if (g.transposed) {
    weight_gemm(ctx, x, dy, g.w, beta);  // dW^T = x^T dy
  } else {
    weight_gemm(ctx, dy, x, g.w, beta);  // dW = dy^T x
  }
  if (g.b.defined()) bias_grad(*ctx.backend, dy, g.b, beta);  // db = 1^T dy
}

NormSaved norm_forward(const BlockContext& ctx, const Tensor& gain, const Tensor& x) {
  const int64_t T = ctx.rows(), h = ctx.config->hidden_size;
  FP_CHECK(x.numel() == T * h, "norm input {} for T={} h={}", x.describe(), T, h);
  NormSaved s{x, stat_like({T}, x), act_like({T, h}, x)};
  ctx.backend->rmsnorm_forward(x, gain, ctx.config->rms_norm_eps, s.a, s.rstd);
  return s;
}

Tensor norm_backward(const BlockContext& ctx, const Tensor& gain, const NormSaved& s, const Tensor& d_a,
                     const Tensor* d_residual, Tensor& g_gain) {
  // a = norm(x); dx = d_residual + norm^T(d_a)
  Tensor dx = act_like({ctx.rows(), ctx.config->hidden_size}, d_a);
  ctx.backend->rmsnorm_backward(s.x, gain, s.rstd, d_a, dx, g_gain);
  if (d_residual != nullptr) ctx.backend->add_inplace(*d_residual, dx);
  return dx;
}

QkvSaved qkv_forward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a,
                     const std::function<void(const Tensor& k, const Tensor& v)>& kv_ready) {
  Backend& be = *ctx.backend;
  const int64_t B = ctx.batch, S = ctx.seq, T = ctx.rows(), d = ctx.config->head_dim();
  const int64_t n_q = w.wq.dim(0) / d, n_k = w.wk.dim(0) / d;
  const bool normed = w.q_norm.defined();
  FP_CHECK(normed == w.k_norm.defined() && w.bq.defined() == w.bk.defined() && w.bk.defined() == w.bv.defined(),
           "q/k/v variant weights defined in part");
  QkvSaved s{act_like({B, S, n_q, d}, a), act_like({B, S, n_k, d}, a), act_like({B, S, n_k, d}, a)};
  if (normed) {
    s.q_raw = act_like({B, S, n_q, d}, a);
    s.k_raw = act_like({B, S, n_k, d}, a);
    s.q_rstd = stat_like({T * n_q}, a);
    s.k_rstd = stat_like({T * n_k}, a);
  }
  // The projections land in the raw tensors when a norm follows, else in q, k directly.
  Tensor q2 = (normed ? s.q_raw : s.q).reshape({T, n_q * d}), k2 = (normed ? s.k_raw : s.k).reshape({T, n_k * d});
  Tensor v2 = s.v.reshape({T, n_k * d});
  linear_forward(be, LinearView{w.wk, false, w.bk}, a, k2, 0.0f);
  linear_forward(be, LinearView{w.wv, false, w.bv}, a, v2, 0.0f);
  if (normed) head_norm_forward(ctx, w.k_norm, s.k_raw, s.k, s.k_rstd);
  be.rope_forward(*ctx.rope_table, s.k);
  if (kv_ready) kv_ready(s.k, s.v);
  linear_forward(be, LinearView{w.wq, false, w.bq}, a, q2, 0.0f);
  if (normed) head_norm_forward(ctx, w.q_norm, s.q_raw, s.q, s.q_rstd);
  be.rope_forward(*ctx.rope_table, s.q);
  return s;
}

namespace {

// q = rope(a Wq^T): with dq rotated back, the input gradient d_a (+)= dq Wq, and Wq's.
void q_input_grad(const BlockContext& ctx, const QkvWeights& w, const Tensor& dq, Tensor& d_a, float beta) {
  linear_backward_input(*ctx.backend, LinearView{w.wq}, dq.reshape({ctx.rows(), w.wq.dim(0)}), d_a, beta);
}
void q_weight_grad(const BlockContext& ctx, const Tensor& dq, const Tensor& a, QkvWeights& g, float g_beta) {
  LinearView gq{g.wq, false, g.bq};
  linear_backward_weight(ctx, gq, dq.reshape({ctx.rows(), g.wq.dim(0)}), a, g_beta);
}
// k = rope(a Wk^T), v = a Wv^T: with dk rotated back, d_a (+)= dk Wk + dv Wv.
void kv_input_grad(const BlockContext& ctx, const QkvWeights& w, const Tensor& dk, const Tensor& dv, Tensor& d_a,
                   float beta) {
  Backend& be = *ctx.backend;
  linear_backward_input(be, LinearView{w.wk}, dk.reshape({ctx.rows(), w.wk.dim(0)}), d_a, beta);
  linear_backward_input(be, LinearView{w.wv}, dv.reshape({ctx.rows(), w.wv.dim(0)}), d_a, 1.0f);
}
void k_weight_grad(const BlockContext& ctx, const Tensor& dk, const Tensor& a, QkvWeights& g, float g_beta) {
  LinearView gk{g.wk, false, g.bk};
  linear_backward_weight(ctx, gk, dk.reshape({ctx.rows(), g.wk.dim(0)}), a, g_beta);
}
void v_weight_grad(const BlockContext& ctx, const Tensor& dv, const Tensor& a, QkvWeights& g, float g_beta) {
  LinearView gv{g.wv, false, g.bv};
  linear_backward_weight(ctx, gv, dv.reshape({ctx.rows(), g.wv.dim(0)}), a, g_beta);
}

// dq (dk) after RoPE's adjoint, back through the q (k) norm when there is one: the gradient
// at the projection's output, in place of `d`.
void unnorm_q(const BlockContext& ctx, const QkvWeights& w, const QkvSaved* s, Tensor& dq, QkvWeights& g,
              float g_beta) {
  if (!w.q_norm.defined()) return;
  FP_CHECK(s != nullptr && s->q_raw.defined(), "q norm backward without the forward's saved state");
  dq = head_norm_backward(ctx, w.q_norm, s->q_raw, s->q_rstd, dq, g.q_norm, g_beta);
}
void unnorm_k(const BlockContext& ctx, const QkvWeights& w, const QkvSaved* s, Tensor& dk, QkvWeights& g,
              float g_beta) {
  if (!w.k_norm.defined()) return;
  FP_CHECK(s != nullptr && s->k_raw.defined(), "k norm backward without the forward's saved state");
  dk = head_norm_backward(ctx, w.k_norm, s->k_raw, s->k_rstd, dk, g.k_norm, g_beta);
}

}  // namespace

void q_backward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a, Tensor& dq, Tensor& d_a,
                QkvWeights& g, float g_beta, const QkvSaved* saved) {
  ctx.backend->rope_backward(*ctx.rope_table, dq);
  unnorm_q(ctx, w, saved, dq, g, g_beta);
  q_input_grad(ctx, w, dq, d_a, allocate_or_accumulate(d_a, a.shape(), dq));
  q_weight_grad(ctx, dq, a, g, g_beta);
}

void kv_backward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a, Tensor& dk, const Tensor& dv,
                 Tensor& d_a, QkvWeights& g, float g_beta, const QkvSaved* saved) {
  ctx.backend->rope_backward(*ctx.rope_table, dk);
  unnorm_k(ctx, w, saved, dk, g, g_beta);
  kv_input_grad(ctx, w, dk, dv, d_a, allocate_or_accumulate(d_a, a.shape(), dk));
  k_weight_grad(ctx, dk, a, g, g_beta);
  v_weight_grad(ctx, dv, a, g, g_beta);
}

void qkv_backward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a, const QkvGrads& d, Tensor& d_a,
                  QkvWeights& g, float g_beta, const BackwardSchedule& sched, const QkvSaved* saved) {
  ctx.backend->rope_backward(*ctx.rope_table, *d.dq);
  ctx.backend->rope_backward(*ctx.rope_table, *d.dk);
  unnorm_q(ctx, w, saved, *d.dq, g, g_beta);
  unnorm_k(ctx, w, saved, *d.dk, g, g_beta);
  q_input_grad(ctx, w, *d.dq, d_a, allocate_or_accumulate(d_a, a.shape(), *d.dq, sched.d_input_category));
  kv_input_grad(ctx, w, *d.dk, *d.dv, d_a, 1.0f);
  run(sched.input_done);
  q_weight_grad(ctx, *d.dq, a, g, g_beta);
  run(sched.between);
  k_weight_grad(ctx, *d.dk, a, g, g_beta);
  run(sched.between);
  v_weight_grad(ctx, *d.dv, a, g, g_beta);
}

Tensor residual_forward(const BlockContext& ctx, const Tensor& x) {
  Tensor y = act_like({ctx.rows(), ctx.config->hidden_size}, x);
  ctx.backend->copy(x, y);
  return y;
}

void attn_output_forward(const BlockContext& ctx, const LinearView& wo, const Tensor& attn, Tensor& y,
                         float y_beta) {
  const Tensor attn2 = attn.reshape({ctx.rows(), attn.numel() / ctx.rows()});
  linear_forward(*ctx.backend, wo, attn2, y, y_beta);
}

Tensor attn_output_backward(const BlockContext& ctx, const LinearView& wo, const Tensor& attn, const Tensor& dy,
                            LinearView& g_wo, float g_beta, const std::function<void()>& between) {
  // y += attn Wo^T: d_attn = dy Wo, dWo += dy^T attn
  const Tensor attn2 = attn.reshape({ctx.rows(), attn.numel() / ctx.rows()});
  Tensor d_attn = act_like(attn.shape(), dy);
  Tensor d_attn2 = d_attn.reshape(attn2.shape());
  linear_backward_input(*ctx.backend, wo, dy, d_attn2, 0.0f);
  run(between);
  linear_backward_weight(ctx, g_wo, dy, attn2, g_beta);
  return d_attn;
}

void mlp_forward(const BlockContext& ctx, const MlpWeights& w, const Tensor& a, Tensor& y, MlpSaved* saved,
                 const std::function<void()>& between_gemms, float y_beta) {
  Backend& be = *ctx.backend;
  const int64_t T = ctx.rows(), fc = w.w_gate.dim(0);
  Tensor gate = act_like({T, fc}, a), up = act_like({T, fc}, a), act = act_like({T, fc}, a);
  be.matmul(a, false, w.w_gate, true, gate);
  if (w.b_gate.defined()) add_bias(be, w.b_gate, gate);
  run(between_gemms);
  be.matmul(a, false, w.w_up, true, up);
  if (w.b_up.defined()) add_bias(be, w.b_up, up);
  be.swiglu_forward(gate, up, act);
  linear_forward(be, w.down, act, y, y_beta);
  if (saved != nullptr) *saved = MlpSaved{std::move(gate), std::move(up), std::move(act)};
}

MlpInputGrads mlp_backward_input(const BlockContext& ctx, const MlpWeights& w, const MlpSaved& s, const Tensor& dy,
                                 Tensor& d_a, MlpWeights& g, float g_beta, const BackwardSchedule& sched) {
  Backend& be = *ctx.backend;
  const int64_t T = ctx.rows(), fc = w.w_gate.dim(0);
  // y += act Wd^T: d_act = dy Wd, dWd += dy^T act
  Tensor d_act = act_like({T, fc}, dy);
  linear_backward_input(be, w.down, dy, d_act, 0.0f);
  run(sched.between);
  linear_backward_weight(ctx, g.down, dy, s.act, g_beta);
  MlpInputGrads d{act_like({T, fc}, dy), act_like({T, fc}, dy)};
  be.swiglu_backward(s.gate, s.up, d_act, d.d_gate, d.d_up);
  d_act = Tensor();
  // gate = a Wg^T, up = a Wu^T: d_a (+)= d_gate Wg + d_up Wu
  const float beta = allocate_or_accumulate(d_a, {T, ctx.config->hidden_size}, dy, sched.d_input_category);
  be.matmul(d.d_gate, false, w.w_gate, false, d_a, 1.0f, beta);
  be.matmul(d.d_up, false, w.w_up, false, d_a, 1.0f, 1.0f);
  return d;
}

void mlp_backward_weight(const BlockContext& ctx, const MlpInputGrads& d, const Tensor& a, MlpWeights& g,
                         float g_beta, const BackwardSchedule& sched) {
  Backend& be = *ctx.backend;
  weight_gemm(ctx, d.d_gate, a, g.w_gate, g_beta);
  if (g.b_gate.defined()) bias_grad(be, d.d_gate, g.b_gate, g_beta);
  run(sched.between);
  weight_gemm(ctx, d.d_up, a, g.w_up, g_beta);
  if (g.b_up.defined()) bias_grad(be, d.d_up, g.b_up, g_beta);
}

void mlp_backward(const BlockContext& ctx, const MlpWeights& w, const MlpSaved& s, const Tensor& a,
                  const Tensor& dy, Tensor& d_a, MlpWeights& g, float g_beta) {
  const MlpInputGrads d = mlp_backward_input(ctx, w, s, dy, d_a, g, g_beta);
  mlp_backward_weight(ctx, d, a, g, g_beta);
}

}  // namespace foldpar
