// FLOP counting (see flop_count.h for what counts).
#include "model/flop_count.h"

namespace foldpar {

double forward_matmul_flops(const LlamaConfig& c, int64_t tokens) {
  const double h = static_cast<double>(c.hidden_size), f = static_cast<double>(c.intermediate_size),
               kv = static_cast<double>(c.kv_dim());
  const double per_layer = 2 * h * static_cast<double>(c.q_dim()) + 2 * h * kv + 3 * h * f;
  const double weights = static_cast<double>(c.num_hidden_layers) * per_layer + static_cast<double>(c.vocab_size) * h;
  return 2.0 * static_cast<double>(tokens) * weights;
}

int64_t layer_matmul_flops_per_token(const LlamaConfig& c, int64_t layer) {
  const int64_t h = c.hidden_size;
  const int64_t attention = 2 * h * c.q_dim() + 2 * h * c.kv_dim();  // q, o; k, v
  const MoeConfig& m = c.moe;
  int64_t mlp = 3 * h * c.intermediate_size;
  if (m.enabled() && m.is_sparse_layer(layer)) {
    mlp = m.num_experts * h + m.num_experts_per_tok * 3 * h * m.moe_intermediate_size;
    if (m.shared_expert_intermediate_size > 0) mlp += 3 * h * m.shared_expert_intermediate_size + h;
  }
  return 2 * (attention + mlp);
}

int64_t head_matmul_flops_per_token(const LlamaConfig& c) { return 2 * c.hidden_size * c.vocab_size; }

double forward_attention_flops(const LlamaConfig& c, int64_t batch, int64_t seq) {
  // Causal: S(S+1)/2. A window W < S: query i sees min(i + 1, W) keys, S(S+1)/2 less the
  // (S-W)(S-W+1)/2 pairs behind the window.
  const double S = static_cast<double>(seq), W = static_cast<double>(c.sliding_window);
  double pairs = S * (S + 1) / 2.0;
  if (c.sliding_window > 0 && c.sliding_window < seq) pairs -= (S - W) * (S - W + 1) / 2.0;
  return 4.0 * static_cast<double>(c.head_dim()) * static_cast<double>(c.num_attention_heads) * pairs *
         static_cast<double>(batch) * static_cast<double>(c.num_hidden_layers);
}

double train_step_flops(const LlamaConfig& c, int64_t batch, int64_t seq) {
  return 3.0 * (forward_matmul_flops(c, batch * seq) + forward_attention_flops(c, batch, seq));
}

}  // namespace foldpar
