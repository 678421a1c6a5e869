// One Llama decoder block on one device: pre-norm attention (RoPE, GQA, causal by explicit
// positions) and a pre-norm SiLU-gated MLP, each with a residual add; forward and the
// hand-written backward, composed from the sub-blocks of model/sub_blocks.h over the whole
// width (every head, every MLP column). Pure math over a Backend: no communication.
#pragma once

#include "backend/backend.h"
#include "model/llama_config.h"
#include "model/llama_weights.h"
#include "model/moe_layer.h"
#include "model/sub_blocks.h"

namespace foldpar {

// What a block's forward keeps for its backward. T = B*S token rows, batch-major.
struct BlockSaved {
  NormSaved attn_norm;  // x_in [T, h] (shared with the previous block's output), rstd, a1
  QkvSaved qkv;         // q [B, S, n_h, d], k, v [B, S, n_kv, d] (q, k after RoPE)
  Tensor attn;          // [B, S, n_h, d] attention output before o_proj
  Tensor lse;           // [B, n_h, S] attention log-sum-exp
  NormSaved mlp_norm;   // x_mid [T, h] residual stream after attention, rstd, a2
  MlpSaved mlp;         // gate, up, act [T, f] (dense layers)
  MoeSaved moe;         // routing, dispatched rows, per-expert MLP state (sparse layers)
};

// The sub-block weight views of a whole layer.
QkvWeights qkv_weights(const LayerWeights& w);
LinearView wo_view(const LayerWeights& w);
MlpWeights mlp_weights(const LayerWeights& w);

// x_in: [T, h]. Returns x_out [T, h] (new activation tensor). When `saved` is not null it
// receives everything block_backward needs; otherwise intermediates are freed as soon as
// they are used.
Tensor block_forward(const BlockContext& ctx, const LayerWeights& w, const Tensor& x_in, BlockSaved* saved);

// dx_out: [T, h], the gradient at the block output. Returns dx_in [T, h]; the weight
// gradients are accumulated (+=) into g.
Tensor block_backward(const BlockContext& ctx, const LayerWeights& w, const BlockSaved& s, const Tensor& dx_out,
                      LayerWeights& g);

}  // namespace foldpar
