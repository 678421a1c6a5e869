// LlamaConfig: the model hyper-parameters, read from a Hugging Face style config.json.
// Validation here covers the model alone; parallel layouts add their own divisibility
// checks (parallel/).
#pragma once

#include <cstdint>
#include <string>

#include "backend/rope_table.h"
#include "core/status.h"
#include "model/moe_config.h"

namespace foldpar {

struct LlamaConfig {
  int64_t hidden_size = 0;              // h
  int64_t intermediate_size = 0;        // f, the gated MLP width
  int64_t num_attention_heads = 0;      // n_h
  int64_t num_key_value_heads = 0;      // n_kv; n_h % n_kv == 0 (GQA group g = n_h / n_kv)
  int64_t num_hidden_layers = 0;        // L
  int64_t vocab_size = 0;               // V
  int64_t max_position_embeddings = 0;  // longest sequence RoPE positions are meant for
  double rms_norm_eps = 1e-6;           // added to mean(x^2) in every RMSNorm
  double rope_theta = 10000.0;          // RoPE base
  bool tie_word_embeddings = false;     // LM head shares the embedding matrix
  // ---- attention variants of the Hugging Face families (issue 21) ----
  RopeScaling rope_scaling;             // "rope_scaling": linear, dynamic, llama3, yarn
  int64_t explicit_head_dim = 0;        // "head_dim" (Qwen3: 128 with h / n_h = 64); 0: h / n_h
  bool qkv_bias = false;                // q_proj, k_proj, v_proj have biases (qwen2; "attention_bias")
  bool o_bias = false;                  // o_proj has a bias ("attention_bias" of llama and qwen3)
  bool qk_norm = false;                 // per-head RMSNorm of q and k before RoPE, gains [d] (qwen3)
  bool mlp_bias = false;                // gate_proj, up_proj, down_proj have biases (llama's "mlp_bias")
  // Sliding-window attention W (mistral, mixtral: "sliding_window"), every layer: query i sees
  // keys j with i - W < j <= i. 0: full causal.
  int64_t sliding_window = 0;
  MoeConfig moe;                        // experts (model_type mixtral, qwen2_moe, qwen3_moe); none: dense

  // d: q proj [n_h*d, h], o proj [h, n_h*d], k and v proj [n_kv*d, h].
  int64_t head_dim() const { return explicit_head_dim > 0 ? explicit_head_dim : hidden_size / num_attention_heads; }
  int64_t q_dim() const { return num_attention_heads * head_dim(); }  // n_h * d (= h unless head_dim is set)
  int64_t kv_dim() const { return num_key_value_heads * head_dim(); }
  // What the RoPE tables of this model are a function of (backend/rope_table.h).
  RopeSpec rope_spec() const { return RopeSpec{head_dim(), rope_theta, max_position_embeddings, rope_scaling}; }
  int64_t group() const { return num_attention_heads / num_key_value_heads; }  // g
  // Total parameter count (embedding counted once when tied).
  int64_t parameter_count() const;

  // Checks positivity, divisibility (h % n_h without head_dim, n_h % n_kv, even head_dim) and sane ranges;
  // messages name the values.
  Status validate() const;

  static Result<LlamaConfig> from_json(const std::string& text);
  static Result<LlamaConfig> load(const std::string& path);
  // Hugging Face style JSON (with architectures and model_type), loadable by from_json.
  std::string to_json() const;
};

}  // namespace foldpar
