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
