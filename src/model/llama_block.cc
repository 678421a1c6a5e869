// Llama block forward and backward as the composition of the sub-blocks (model/sub_blocks.h)
// with the attention core between them. The backward calls them in reverse order.
#include "model/llama_block.h"

#include <cmath>

#include "backend/bf16_storage_backend.h"

namespace foldpar {

QkvWeights qkv_weights(const LayerWeights& w) { return QkvWeights{w.wq, w.wk, w.wv, w.bq, w.bk, w.bv, w.q_norm, w.k_norm}; }
LinearView wo_view(const LayerWeights& w) { return LinearView{w.wo, false, w.bo}; }
MlpWeights mlp_weights(const LayerWeights& w) {
  return MlpWeights{w.w_gate, w.w_up, LinearView{w.w_down, false, w.b_down}, w.b_gate, w.b_up};
}

namespace {

AttentionArgs attention_args(const BlockContext& ctx, const QkvSaved& qkv) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(ctx.config->head_dim()));
  return AttentionArgs{&qkv.q, &qkv.k, &qkv.v, ctx.positions, ctx.positions, scale, ctx.config->sliding_window};
}

}  // namespace

Tensor block_forward(const BlockContext& ctx, const LayerWeights& w, const Tensor& x_in, BlockSaved* saved) {
  const LlamaConfig& c = *ctx.config;
  const int64_t B = ctx.batch, S = ctx.seq, n_h = c.num_attention_heads, d = c.head_dim();
  BlockSaved s;
  // ---- attention: x_mid = x_in + attn(norm(x_in)) Wo^T ----
  s.attn_norm = norm_forward(ctx, w.attn_norm, x_in);             // a1 [T, h]
  s.qkv = qkv_forward(ctx, qkv_weights(w), s.attn_norm.a);      // q, k, v [B, S, n, d]
  s.attn = Tensor::empty({B, S, n_h, d}, x_in.dtype(), MemCategory::kActivations);
  s.lse = Tensor::empty({B, n_h, S}, stat_dtype(x_in.dtype()), MemCategory::kActivations);
  ctx.backend->attention_forward(attention_args(ctx, s.qkv), s.attn, s.lse);
  Tensor x_mid = residual_forward(ctx, x_in);                     // [T, h]
  attn_output_forward(ctx, wo_view(w), s.attn, x_mid);
  // ---- MLP: x_out = x_mid + (silu(a2 Wg^T) * (a2 Wu^T)) Wd^T, a2 = norm(x_mid) ----
  s.mlp_norm = norm_forward(ctx, w.mlp_norm, x_mid);              // a2 [T, h]
  Tensor x_out = residual_forward(ctx, x_mid);                    // [T, h]
  if (w.moe.defined()) {
    moe_forward(ctx, w.moe, s.mlp_norm.a, x_out, saved != nullptr ? &s.moe : nullptr, ctx.moe_aux);
  } else {
    mlp_forward(ctx, mlp_weights(w), s.mlp_norm.a, x_out, saved != nullptr ? &s.mlp : nullptr);
  }
  if (saved != nullptr) *saved = std::move(s);
  return x_out;
}

Tensor block_backward(const BlockContext& ctx, const LayerWeights& w, const BlockSaved& s, const Tensor& dx_out,
                      LayerWeights& g) {
  const LlamaConfig& c = *ctx.config;
  const int64_t B = ctx.batch, S = ctx.seq, n_h = c.num_attention_heads, n_kv = c.num_key_value_heads,
                d = c.head_dim();
  // ---- MLP ----
  Tensor d_a2;  // [T, h]
  if (w.moe.defined()) {
    moe_backward(ctx, w.moe, s.moe, s.mlp_norm.a, dx_out, d_a2, g.moe,
                 ctx.moe_prob_grad != nullptr ? (*ctx.moe_prob_grad)[w.moe.sparse_index] : std::vector<double>{});
  } else {
    MlpWeights g_mlp = mlp_weights(g);
    mlp_backward(ctx, mlp_weights(w), s.mlp, s.mlp_norm.a, dx_out, d_a2, g_mlp, 1.0f);
  }
  Tensor dx_mid = norm_backward(ctx, w.mlp_norm, s.mlp_norm, d_a2, &dx_out, g.mlp_norm);
  d_a2 = Tensor();
  // ---- attention ----
  LinearView g_wo = wo_view(g);
  Tensor d_attn = attn_output_backward(ctx, wo_view(w), s.attn, dx_mid, g_wo, 1.0f);  // [B, S, n_h, d]
  Tensor dq = Tensor::empty({B, S, n_h, d}, dx_out.dtype(), MemCategory::kActivations);
  Tensor dk = Tensor::empty({B, S, n_kv, d}, dx_out.dtype(), MemCategory::kActivations);
  Tensor dv = Tensor::empty({B, S, n_kv, d}, dx_out.dtype(), MemCategory::kActivations);
  ctx.backend->attention_backward(attention_args(ctx, s.qkv), s.attn, s.lse, d_attn, dq, dk, dv);
  d_attn = Tensor();
  QkvWeights g_qkv = qkv_weights(g);
  Tensor d_a1;  // [T, h]
  q_backward(ctx, qkv_weights(w), s.attn_norm.a, dq, d_a1, g_qkv, 1.0f, &s.qkv);
  kv_backward(ctx, qkv_weights(w), s.attn_norm.a, dk, dv, d_a1, g_qkv, 1.0f, &s.qkv);
  return norm_backward(ctx, w.attn_norm, s.attn_norm, d_a1, &dx_mid, g.attn_norm);
}

}  // namespace foldpar
