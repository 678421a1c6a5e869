// One Llama decoder block on one device: pre-norm attention (RoPE, GQA, causal by explicit
// positions) and a pre-norm SiLU-gated MLP, each with a residual add; forward and the
// hand-written backward. Pure math over a Backend: no communication (a parallel strategy
// assembles its own block from these ops and comm).
#pragma once

#include "backend/backend.h"
#include "model/llama_config.h"
#include "model/llama_weights.h"

namespace foldpar {

// What a block's forward keeps for its backward. T = B*S token rows, batch-major.
struct BlockSaved {
  Tensor x_in;      // [T, h] block input (shared with the previous block's output)
  Tensor rstd_attn; // [T]
  Tensor a1;        // [T, h] input_layernorm output
  Tensor q;         // [B, S, n_h, d] after RoPE
  Tensor k;         // [B, S, n_kv, d] after RoPE
  Tensor v;         // [B, S, n_kv, d]
  Tensor attn;      // [B, S, n_h, d] attention output before o_proj
  Tensor lse;       // [B, n_h, S] attention log-sum-exp
  Tensor x_mid;     // [T, h] residual stream after attention
  Tensor rstd_mlp;  // [T]
  Tensor a2;        // [T, h] post_attention_layernorm output
  Tensor gate;      // [T, f]
  Tensor up;        // [T, f]
  Tensor act;       // [T, f] silu(gate) * up
};

// The per-step constants every block of a forward shares.
struct BlockContext {
  const LlamaConfig* config = nullptr;
  Backend* backend = nullptr;
  int64_t batch = 0;             // B
  int64_t seq = 0;               // S (rows per batch entry)
  const Tensor* positions = nullptr;   // i32 [S], global positions of the rows
  const Tensor* rope_table = nullptr;  // [S, 2, d/2] from build_rope_table(positions)
};

// x_in: [T, h]. Returns x_out [T, h] (new activation tensor). When `saved` is not null it
// receives everything block_backward needs; otherwise intermediates are freed as soon as
// they are used.
Tensor block_forward(const BlockContext& ctx, const LayerWeights& w, const Tensor& x_in, BlockSaved* saved);

// dx_out: [T, h], the gradient at the block output. Returns dx_in [T, h]; the weight
// gradients are accumulated (+=) into g.
Tensor block_backward(const BlockContext& ctx, const LayerWeights& w, const BlockSaved& s, const Tensor& dx_out,
                      LayerWeights& g);

}  // namespace foldpar
