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

// A d_input passed undefined is allocated here and written (beta 0); a defined one is added to.
float allocate_or_accumulate(Tensor& d, const Shape& shape, const Tensor& like) {
  if (d.defined()) return 1.0f;
  d = act_like(shape, like);
  return 0.0f;
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

QkvSaved qkv_forward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a) {
  Backend& be = *ctx.backend;
  const int64_t B = ctx.batch, S = ctx.seq, T = ctx.rows(), d = ctx.config->head_dim();
  const int64_t n_q = w.wq.dim(0) / d, n_k = w.wk.dim(0) / d;
  QkvSaved s{act_like({B, S, n_q, d}, a), act_like({B, S, n_k, d}, a), act_like({B, S, n_k, d}, a)};
  Tensor q2 = s.q.reshape({T, n_q * d}), k2 = s.k.reshape({T, n_k * d}), v2 = s.v.reshape({T, n_k * d});
  be.matmul(a, false, w.wq, true, q2);
  be.matmul(a, false, w.wk, true, k2);
  be.matmul(a, false, w.wv, true, v2);
  be.rope_forward(*ctx.rope_table, s.q);
  be.rope_forward(*ctx.rope_table, s.k);
  return s;
}

void q_backward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a, Tensor& dq, Tensor& d_a,
                QkvWeights& g, float g_beta) {
  Backend& be = *ctx.backend;
  // q = rope(a Wq^T)
  be.rope_backward(*ctx.rope_table, dq);
  const Tensor dq2 = dq.reshape({ctx.rows(), w.wq.dim(0)});
  const float beta = allocate_or_accumulate(d_a, a.shape(), dq);
  be.matmul(dq2, false, w.wq, false, d_a, 1.0f, beta);
  be.matmul(dq2, true, a, false, g.wq, 1.0f, g_beta);
}

void kv_backward(const BlockContext& ctx, const QkvWeights& w, const Tensor& a, Tensor& dk, const Tensor& dv,
                 Tensor& d_a, QkvWeights& g, float g_beta) {
  Backend& be = *ctx.backend;
  // k = rope(a Wk^T), v = a Wv^T
  be.rope_backward(*ctx.rope_table, dk);
  const Tensor dk2 = dk.reshape({ctx.rows(), w.wk.dim(0)}), dv2 = dv.reshape({ctx.rows(), w.wv.dim(0)});
  const float beta = allocate_or_accumulate(d_a, a.shape(), dk);
  be.matmul(dk2, false, w.wk, false, d_a, 1.0f, beta);
  be.matmul(dv2, false, w.wv, false, d_a, 1.0f, 1.0f);
  be.matmul(dk2, true, a, false, g.wk, 1.0f, g_beta);
  be.matmul(dv2, true, a, false, g.wv, 1.0f, g_beta);
}

Tensor residual_forward(const BlockContext& ctx, const Tensor& x) {
  Tensor y = act_like({ctx.rows(), ctx.config->hidden_size}, x);
  ctx.backend->copy(x, y);
  return y;
}

void attn_output_forward(const BlockContext& ctx, const LinearView& wo, const Tensor& attn, Tensor& y) {
  const Tensor attn2 = attn.reshape({ctx.rows(), attn.numel() / ctx.rows()});
  linear_forward(*ctx.backend, wo, attn2, y, 1.0f);
}

Tensor attn_output_backward(const BlockContext& ctx, const LinearView& wo, const Tensor& attn, const Tensor& dy,
                            LinearView& g_wo, float g_beta) {
  // y += attn Wo^T: d_attn = dy Wo, dWo += dy^T attn
  const Tensor attn2 = attn.reshape({ctx.rows(), attn.numel() / ctx.rows()});
  Tensor d_attn = act_like(attn.shape(), dy);
  Tensor d_attn2 = d_attn.reshape(attn2.shape());
  linear_backward_input(*ctx.backend, wo, dy, d_attn2, 0.0f);
  linear_backward_weight(*ctx.backend, g_wo, dy, attn2, g_beta);
  return d_attn;
}

void mlp_forward(const BlockContext& ctx, const MlpWeights& w, const Tensor& a, Tensor& y, MlpSaved* saved,
                 const std::function<void()>& between_gemms) {
  Backend& be = *ctx.backend;
  const int64_t T = ctx.rows(), fc = w.w_gate.dim(0);
  Tensor gate = act_like({T, fc}, a), up = act_like({T, fc}, a), act = act_like({T, fc}, a);
  be.matmul(a, false, w.w_gate, true, gate);
  if (between_gemms) between_gemms();
  be.matmul(a, false, w.w_up, true, up);
  be.swiglu_forward(gate, up, act);
  linear_forward(be, w.down, act, y, 1.0f);
  if (saved != nullptr) *saved = MlpSaved{std::move(gate), std::move(up), std::move(act)};
}

void mlp_backward(const BlockContext& ctx, const MlpWeights& w, const MlpSaved& s, const Tensor& a,
                  const Tensor& dy, Tensor& d_a, MlpWeights& g, float g_beta) {
  Backend& be = *ctx.backend;
  const int64_t T = ctx.rows(), fc = w.w_gate.dim(0);
  // y += act Wd^T: d_act = dy Wd, dWd += dy^T act
  Tensor d_act = act_like({T, fc}, dy);
  linear_backward_input(be, w.down, dy, d_act, 0.0f);
  linear_backward_weight(be, g.down, dy, s.act, g_beta);
  Tensor d_gate = act_like({T, fc}, dy), d_up = act_like({T, fc}, dy);
  be.swiglu_backward(s.gate, s.up, d_act, d_gate, d_up);
  d_act = Tensor();
  // gate = a Wg^T, up = a Wu^T
  const float beta = allocate_or_accumulate(d_a, a.shape(), dy);
  be.matmul(d_gate, false, w.w_gate, false, d_a, 1.0f, beta);
  be.matmul(d_up, false, w.w_up, false, d_a, 1.0f, 1.0f);
  be.matmul(d_gate, true, a, false, g.w_gate, 1.0f, g_beta);
  be.matmul(d_up, true, a, false, g.w_up, 1.0f, g_beta);
}

}  // namespace foldpar
