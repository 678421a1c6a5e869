// Llama block forward and backward. The backward mirrors the forward line by line in
// reverse; every matmul's gradient pair is written next to it:
//   y = x W^T   =>   dx (+)= dy W,   dW += dy^T x.
#include "model/llama_block.h"

#include <cmath>

#include "backend/bf16_storage_backend.h"

namespace foldpar {
namespace {

Tensor act_like(const Shape& shape, const Tensor& like) {
  return Tensor::empty(shape, like.dtype(), MemCategory::kActivations);
}

// Per-row statistics (rstd, lse) stay f32 beside bf16 activations (backend/bf16_storage_backend.h).
Tensor stat_like(const Shape& shape, const Tensor& like) {
  return Tensor::empty(shape, stat_dtype(like.dtype()), MemCategory::kActivations);
}

}  // namespace

Tensor block_forward(const BlockContext& ctx, const LayerWeights& w, const Tensor& x_in, BlockSaved* saved) {
  const LlamaConfig& c = *ctx.config;
  Backend& be = *ctx.backend;
  const int64_t B = ctx.batch, S = ctx.seq, T = B * S, h = c.hidden_size, f = c.intermediate_size,
                n_h = c.num_attention_heads, n_kv = c.num_key_value_heads, d = c.head_dim();
  FP_CHECK(x_in.numel() == T * h, "block input {} for T={} h={}", x_in.describe(), T, h);

  // ---- attention: x_mid = x_in + attn(norm(x_in)) Wo^T ----
  Tensor rstd_attn = stat_like({T}, x_in);
  Tensor a1 = act_like({T, h}, x_in);
  be.rmsnorm_forward(x_in, w.attn_norm, c.rms_norm_eps, a1, rstd_attn);
  Tensor q = act_like({B, S, n_h, d}, x_in);
  Tensor k = act_like({B, S, n_kv, d}, x_in);
  Tensor v = act_like({B, S, n_kv, d}, x_in);
  Tensor q2 = q.reshape({T, n_h * d}), k2 = k.reshape({T, n_kv * d}), v2 = v.reshape({T, n_kv * d});
  be.matmul(a1, false, w.wq, true, q2);
  be.matmul(a1, false, w.wk, true, k2);
  be.matmul(a1, false, w.wv, true, v2);
  be.rope_forward(*ctx.rope_table, q);
  be.rope_forward(*ctx.rope_table, k);
  Tensor attn = act_like({B, S, n_h, d}, x_in);
  Tensor lse = stat_like({B, n_h, S}, x_in);
  AttentionArgs args{&q, &k, &v, ctx.positions, ctx.positions, 1.0 / std::sqrt(static_cast<double>(d))};
  be.attention_forward(args, attn, lse);
  Tensor x_mid = act_like({T, h}, x_in);
  be.copy(x_in, x_mid);
  be.matmul(attn.reshape({T, n_h * d}), false, w.wo, true, x_mid, 1.0f, 1.0f);

  // ---- MLP: x_out = x_mid + (silu(a2 Wg^T) * (a2 Wu^T)) Wd^T, a2 = norm(x_mid) ----
  Tensor rstd_mlp = stat_like({T}, x_in);
  Tensor a2 = act_like({T, h}, x_in);
  be.rmsnorm_forward(x_mid, w.mlp_norm, c.rms_norm_eps, a2, rstd_mlp);
  Tensor gate = act_like({T, f}, x_in);
  Tensor up = act_like({T, f}, x_in);
  be.matmul(a2, false, w.w_gate, true, gate);
  be.matmul(a2, false, w.w_up, true, up);
  Tensor act = act_like({T, f}, x_in);
  be.swiglu_forward(gate, up, act);
  Tensor x_out = act_like({T, h}, x_in);
  be.copy(x_mid, x_out);
  be.matmul(act, false, w.w_down, true, x_out, 1.0f, 1.0f);

  if (saved != nullptr) {
    *saved = BlockSaved{x_in, std::move(rstd_attn), std::move(a1), std::move(q),    std::move(k),
                        std::move(v), std::move(attn),   std::move(lse), std::move(x_mid), std::move(rstd_mlp),
                        std::move(a2), std::move(gate),  std::move(up), std::move(act)};
  }
  return x_out;
}

Tensor block_backward(const BlockContext& ctx, const LayerWeights& w, const BlockSaved& s, const Tensor& dx_out,
                      LayerWeights& g) {
  const LlamaConfig& c = *ctx.config;
  Backend& be = *ctx.backend;
  const int64_t B = ctx.batch, S = ctx.seq, T = B * S, h = c.hidden_size, f = c.intermediate_size,
                n_h = c.num_attention_heads, n_kv = c.num_key_value_heads, d = c.head_dim();

  // ---- MLP ----
  // x_out = x_mid + act Wd^T
  Tensor d_act = act_like({T, f}, dx_out);
  be.matmul(dx_out, false, w.w_down, false, d_act);           // d_act = dy Wd
  be.matmul(dx_out, true, s.act, false, g.w_down, 1.0f, 1.0f);  // dWd += dy^T act
  Tensor d_gate = act_like({T, f}, dx_out);
  Tensor d_up = act_like({T, f}, dx_out);
  be.swiglu_backward(s.gate, s.up, d_act, d_gate, d_up);
  d_act = Tensor();
  // gate = a2 Wg^T, up = a2 Wu^T
  Tensor d_a2 = act_like({T, h}, dx_out);
  be.matmul(d_gate, false, w.w_gate, false, d_a2);
  be.matmul(d_up, false, w.w_up, false, d_a2, 1.0f, 1.0f);
  be.matmul(d_gate, true, s.a2, false, g.w_gate, 1.0f, 1.0f);
  be.matmul(d_up, true, s.a2, false, g.w_up, 1.0f, 1.0f);
  d_gate = Tensor();
  d_up = Tensor();
  // a2 = norm(x_mid); dx_mid = dx_out + norm^T(d_a2)
  Tensor dx_mid = act_like({T, h}, dx_out);
  be.rmsnorm_backward(s.x_mid, w.mlp_norm, s.rstd_mlp, d_a2, dx_mid, g.mlp_norm);
  be.add_inplace(dx_out, dx_mid);
  d_a2 = Tensor();

  // ---- attention ----
  // x_mid = x_in + attn Wo^T
  Tensor d_attn = act_like({B, S, n_h, d}, dx_out);
  Tensor d_attn2 = d_attn.reshape({T, n_h * d});
  be.matmul(dx_mid, false, w.wo, false, d_attn2);
  be.matmul(dx_mid, true, s.attn.reshape({T, n_h * d}), false, g.wo, 1.0f, 1.0f);
  Tensor dq = act_like({B, S, n_h, d}, dx_out);
  Tensor dk = act_like({B, S, n_kv, d}, dx_out);
  Tensor dv = act_like({B, S, n_kv, d}, dx_out);
  AttentionArgs args{&s.q, &s.k, &s.v, ctx.positions, ctx.positions, 1.0 / std::sqrt(static_cast<double>(d))};
  be.attention_backward(args, s.attn, s.lse, d_attn, dq, dk, dv);
  d_attn = Tensor();
  be.rope_backward(*ctx.rope_table, dq);
  be.rope_backward(*ctx.rope_table, dk);
  // q = a1 Wq^T, k = a1 Wk^T, v = a1 Wv^T
  Tensor d_a1 = act_like({T, h}, dx_out);
  const Tensor dq2 = dq.reshape({T, n_h * d}), dk2 = dk.reshape({T, n_kv * d}), dv2 = dv.reshape({T, n_kv * d});
  be.matmul(dq2, false, w.wq, false, d_a1);
  be.matmul(dk2, false, w.wk, false, d_a1, 1.0f, 1.0f);
  be.matmul(dv2, false, w.wv, false, d_a1, 1.0f, 1.0f);
  be.matmul(dq2, true, s.a1, false, g.wq, 1.0f, 1.0f);
  be.matmul(dk2, true, s.a1, false, g.wk, 1.0f, 1.0f);
  be.matmul(dv2, true, s.a1, false, g.wv, 1.0f, 1.0f);
  // a1 = norm(x_in); dx_in = dx_mid + norm^T(d_a1)
  Tensor dx_in = act_like({T, h}, dx_out);
  be.rmsnorm_backward(s.x_in, w.attn_norm, s.rstd_attn, d_a1, dx_in, g.attn_norm);
  be.add_inplace(dx_mid, dx_in);
  return dx_in;
}

}  // namespace foldpar
