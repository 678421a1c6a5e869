// Useful floating-point operations of the Llama model, for throughput reports. "Useful"
// means the math a non-recomputing implementation must do: 2 FLOPs per multiply-add of
// every matmul; attention counts only visible (query, key) pairs (causal: S(S+1)/2 per
// sequence, fewer under a sliding window), 4*d per pair per head forward and 8*d backward (dV, dP, dQ, dK; recomputing
// the scores is not counted). Norms, RoPE, SiLU and softmax exponentials are not counted.
#pragma once

#include <cstdint>

#include "model/llama_config.h"

namespace foldpar {

// Matmul FLOPs of one forward over T tokens: 2 * T * (weights of every linear layer and the
// LM head).
double forward_matmul_flops(const LlamaConfig& c, int64_t tokens);
// The same per token and per piece, exact integers (the pipeline's stage balance,
// layout/stage_bounds): decoder layer `layer`'s projections (a sparse MoE layer: the router,
// k experts and the shared expert with its gate), and the LM head's 2 h V. The embedding is a
// lookup: no matmul FLOPs.
int64_t layer_matmul_flops_per_token(const LlamaConfig& c, int64_t layer);
int64_t head_matmul_flops_per_token(const LlamaConfig& c);
// Attention FLOPs of one causal forward of B sequences of S tokens.
double forward_attention_flops(const LlamaConfig& c, int64_t batch, int64_t seq);
// Forward + backward: 3x the matmul FLOPs, 3x the attention FLOPs.
double train_step_flops(const LlamaConfig& c, int64_t batch, int64_t seq);

}  // namespace foldpar
