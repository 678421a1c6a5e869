// LlamaWeights: the parameter tensors of a Llama model under their Hugging Face names and
// shapes (linear weights are [out, in], as in the HF state dict). The same struct holds
// gradients (allocated under MemCategory::kGradients). With tied embeddings lm_head is the
// same tensor as embed (and, for gradients, the same accumulator).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/llama_config.h"
#include "tensor/tensor.h"

namespace foldpar {

// One expert's gated MLP (also the shared expert), Hugging Face [out, in] layout.
struct ExpertWeights {
  Tensor w_gate;  // [f_e, h]  experts.j.w1 (Mixtral) / experts.j.gate_proj (Qwen)
  Tensor w_up;    // [f_e, h]  w3 / up_proj
  Tensor w_down;  // [h, f_e]  w2 / down_proj
};

// The mixture-of-experts part of a sparse layer (model/moe_layer.h); undefined in a dense one.
struct MoeLayerWeights {
  Tensor router;                       // [E, h]  block_sparse_moe.gate.weight / mlp.gate.weight
  std::vector<ExpertWeights> experts;  // E
  // [E * 3 f_e, h]: the routed experts' storage, expert j's w_gate, w_up and w_down rows from
  // 3 f_e j (expert_in_block, moe_weights.h); `experts` are views into it, so TSP's expert ring
  // sends it whole and its gradient ring lands in it, with no packing copy. Undefined where
  // the experts were made apart (the ring then packs them).
  Tensor expert_block;
  ExpertWeights shared;                // [f_s, h] ... mlp.shared_expert.*; undefined without one
  Tensor shared_gate;                  // [1, h]  mlp.shared_expert_gate.weight
  int64_t sparse_index = -1;           // this layer's position among the sparse layers (the aux loss's row)
  bool defined() const { return router.defined(); }
};

struct LayerWeights {
  Tensor attn_norm;  // [h]            model.layers.N.input_layernorm.weight
  Tensor wq;         // [n_h*d, h]     self_attn.q_proj.weight
  Tensor wk;         // [n_kv*d, h]    self_attn.k_proj.weight
  Tensor wv;         // [n_kv*d, h]    self_attn.v_proj.weight
  Tensor wo;         // [h, n_h*d]     self_attn.o_proj.weight
  // Attention variants (undefined when the config has none): biases, q/k RMSNorm gains.
  Tensor bq;         // [n_h*d]        self_attn.q_proj.bias   (qkv_bias)
  Tensor bk;         // [n_kv*d]       self_attn.k_proj.bias
  Tensor bv;         // [n_kv*d]       self_attn.v_proj.bias
  Tensor bo;         // [h]            self_attn.o_proj.bias   (o_bias)
  Tensor q_norm;     // [d]            self_attn.q_norm.weight (qk_norm), shared by every head
  Tensor k_norm;     // [d]            self_attn.k_norm.weight
  Tensor mlp_norm;   // [h]            post_attention_layernorm.weight
  Tensor w_gate;     // [f, h]         mlp.gate_proj.weight
  Tensor w_up;       // [f, h]         mlp.up_proj.weight
  Tensor w_down;     // [h, f]         mlp.down_proj.weight
  Tensor b_gate;     // [f]            mlp.gate_proj.bias      (mlp_bias; undefined without)
  Tensor b_up;       // [f]            mlp.up_proj.bias
  Tensor b_down;     // [h]            mlp.down_proj.bias
  MoeLayerWeights moe;  // sparse layers: the router and experts instead of w_gate, w_up, w_down
};

struct LlamaWeights {
  Tensor embed;                      // [V, h]  model.embed_tokens.weight
  std::vector<LayerWeights> layers;  // L
  Tensor final_norm;                 // [h]     model.norm.weight
  Tensor lm_head;                    // [V, h]  lm_head.weight (the embed tensor when tied)
  bool tied = false;
  MoeFamily moe_family = MoeFamily::kMixtral;  // the per-expert Hugging Face names (sparse layers only)

  // Allocates every tensor (uninitialized) for `config`.
  static LlamaWeights allocate(const LlamaConfig& config, DType dtype, MemCategory category);

  // Visits every distinct tensor with its Hugging Face name, in state-dict order; with tied
  // embeddings lm_head is not visited separately.
  void for_each(const std::function<void(const std::string& name, Tensor& t)>& fn);
  void for_each(const std::function<void(const std::string& name, const Tensor& t)>& fn) const;
  void zero();
};

struct InitOptions {
  uint64_t seed = 0;
  double std = 0.02;         // linear and embedding weights ~ N(0, std^2), as Hugging Face initializes Llama
  double norm_jitter = 0.0;  // norm gains = 1 + norm_jitter * N(0, 1); verification uses > 0 so gains are not all 1
};

// Fills every tensor from counter-based random numbers keyed by (seed, tensor name, element
// index), so any shard of a tensor can be generated alone and matches the full tensor.
void init_weights(const InitOptions& options, LlamaWeights& weights);

// Value of element `index` of the tensor called `name` under init_weights (for shards).
double init_value(const InitOptions& options, const std::string& name, int64_t index);

}  // namespace foldpar
