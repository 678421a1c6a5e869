// Sub-block forward and backward. Each backward mirrors its forward in reverse; every
// matmul's gradient pair is written next to it:
//   y = x W^T   =>   dx (+)= dy W,   dW += dy^T x.
#include "model/sub_blocks.h"

#include "backend/bf16_storage_backend.h"

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

}  // namespace

void linear_forward(Backend& be, const LinearView& w, const Tensor& x, Tensor& y, float beta) {
  be.matmul(x, false, w.w, !w.transposed, y, 1.0f, beta);
}

void linear_backward_input(Backend& be, const LinearView& w, const Tensor& dy, Tensor& dx, float beta) {
  be.matmul(dy, false, w.w, w.transposed, dx, 1.0f, beta);
}

void linear_backward_weight(Backend& be, LinearView& g, const Tensor& dy, const Tensor& x, float beta) {
  if (g.transposed) {
    be.matmul(x, true, dy, false, g.w, 1.0f, beta);  // dW^T = x^T dy
  } else {
    be.matmul(dy, true, x, false, g.w, 1.0f, beta);  // dW = dy^T x
  }
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
  QkvSaved s{act_like({B, S, n_q, d}, a), act_like({B, S, n_k, d}, a), act_like({B, S, n_k, d}, a)};
  Tensor q2 = s.q.reshape({T, n_q * d}), k2 = s.k.reshape({T, n_k * d}), v2 = s.v.reshape({T, n_k * d});
  be.matmul(a, false, w.wk, true, k2);
  be.matmul(a, false, w.wv, true, v2);
  be.rope_forward(*ctx.rope_table, s.k);
  if (kv_ready) kv_ready(s.k, s.v);
  be.matmul(a, false, w.wq, true, q2);
  be.rope_forward(*ctx.rope_table, s.q);
  return s;
}

namespace {

// q = rope(a Wq^T): with dq rotated back, the input gradient d_a (+)= dq Wq, and Wq's.
void q_input_grad(const BlockContext& ctx, const QkvWeights& w, const Tensor& dq, Tensor& d_a, float beta) {
  linear_backward_input(*ctx.backend, LinearView{w.wq}, dq.reshape({ctx.rows(), w.wq.dim(0)}), d_a, beta);
}
void q_weight_grad(const BlockContext& ctx, const Tensor& dq, const Tensor& a, QkvWeights& g, float g_beta) {
  LinearView gq{g.wq};
  linear_backward_weight(*ctx.backend, gq, dq.reshape({ctx.rows(), g.wq.dim(0)}), a, g_beta);
}
// k = rope(a Wk^T), v = a Wv^T: with dk rotated back, d_a (+)= dk Wk + dv Wv.
void kv_input_grad(const BlockContext& ctx, const QkvWeights& w, const Tensor& dk, const Tensor& dv, Tensor& d_a,
                   float beta) {
  Backend& be = *ctx.backend;
  linear_backward_input(be, LinearView{w.wk}, dk.reshape({ctx.rows(), w.wk.dim(0)}), d_a, beta);
  linear_backward_input(be, LinearView{w.wv}, dv.reshape({ctx.rows(), w.wv.dim(0)}), d_a, 1.0f);
}
void k_weight_grad(const BlockContext& ctx, const Tensor& dk, const Tensor& a, QkvWeights& g, float g_beta) {
  LinearView gk{g.wk};
  linear_backward_weight(*ctx.backend, gk, dk.reshape({ctx.rows(), g.wk.dim(0)}), a, g_beta);
}
void v_weight_grad(const BlockContext& ctx, const Tensor& dv, const Tensor& a, QkvWeights& g, float g_beta) {
  LinearView gv{g.wv};
  linear_backward_weight(*ctx.backend, gv, dv.reshape({ctx.rows(), g.wv.dim(0)}), a, g_beta);
}

}  // namespace

void q_backward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a, Tensor& dq, Tensor& d_a,
                QkvWeights& g, float g_beta) {
  ctx.backend->rope_backward(*ctx.rope_table, dq);
  q_input_grad(ctx, w, dq, d_a, allocate_or_accumulate(d_a, a.shape(), dq));
  q_weight_grad(ctx, dq, a, g, g_beta);
}

void kv_backward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a, Tensor& dk, const Tensor& dv,
                 Tensor& d_a, QkvWeights& g, float g_beta) {
  ctx.backend->rope_backward(*ctx.rope_table, dk);
  kv_input_grad(ctx, w, dk, dv, d_a, allocate_or_accumulate(d_a, a.shape(), dk));
  k_weight_grad(ctx, dk, a, g, g_beta);
  v_weight_grad(ctx, dv, a, g, g_beta);
}

void qkv_backward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a, const QkvGrads& d, Tensor& d_a,
                  QkvWeights& g, float g_beta, const BackwardSchedule& sched) {
  ctx.backend->rope_backward(*ctx.rope_table, *d.dq);
  ctx.backend->rope_backward(*ctx.rope_table, *d.dk);
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
  linear_backward_weight(*ctx.backend, g_wo, dy, attn2, g_beta);
  return d_attn;
}

void mlp_forward(const BlockContext& ctx, const MlpWeights& w, const Tensor& a, Tensor& y, MlpSaved* saved,
                 const std::function<void()>& between_gemms, float y_beta) {
  Backend& be = *ctx.backend;
  const int64_t T = ctx.rows(), fc = w.w_gate.dim(0);
  Tensor gate = act_like({T, fc}, a), up = act_like({T, fc}, a), act = act_like({T, fc}, a);
  be.matmul(a, false, w.w_gate, true, gate);
  run(between_gemms);
  be.matmul(a, false, w.w_up, true, up);
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
  linear_backward_weight(be, g.down, dy, s.act, g_beta);
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
  be.matmul(d.d_gate, true, a, false, g.w_gate, 1.0f, g_beta);
  run(sched.between);
  be.matmul(d.d_up, true, a, false, g.w_up, 1.0f, g_beta);
}

void mlp_backward(const BlockContext& ctx, const MlpWeights& w, const MlpSaved& s, const Tensor& a,
                  const Tensor& dy, Tensor& d_a, MlpWeights& g, float g_beta) {
  const MlpInputGrads d = mlp_backward_input(ctx, w, s, dy, d_a, g, g_beta);
  mlp_backward_weight(ctx, d, a, g, g_beta);
}

}  // namespace foldpar
