// Allocation, naming and initialization of Llama weights.
#include "model/llama_weights.h"

#include <fmt/format.h>

#include "core/rng.h"
#include "model/init_values.h"
#include "model/moe_weights.h"

namespace foldpar {

LlamaWeights LlamaWeights::allocate(const LlamaConfig& c, DType dtype, MemCategory category) {
  const int64_t h = c.hidden_size, f = c.intermediate_size, q = c.num_attention_heads * c.head_dim(),
                kv = c.kv_dim();
  LlamaWeights w;
  w.tied = c.tie_word_embeddings;
  w.moe_family = c.moe.family;
  int64_t sparse = 0;
  w.embed = Tensor::empty({c.vocab_size, h}, dtype, category);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights lw;
    lw.attn_norm = Tensor::empty({h}, dtype, category);
    lw.wq = Tensor::empty({q, h}, dtype, category);
    lw.wk = Tensor::empty({kv, h}, dtype, category);
    lw.wv = Tensor::empty({kv, h}, dtype, category);
    lw.wo = Tensor::empty({h, q}, dtype, category);
    if (c.qkv_bias) {
      lw.bq = Tensor::empty({q}, dtype, category);
      lw.bk = Tensor::empty({kv}, dtype, category);
      lw.bv = Tensor::empty({kv}, dtype, category);
    }
    if (c.o_bias) lw.bo = Tensor::empty({h}, dtype, category);
    if (c.qk_norm) {
      lw.q_norm = Tensor::empty({c.head_dim()}, dtype, category);
      lw.k_norm = Tensor::empty({c.head_dim()}, dtype, category);
    }
    lw.mlp_norm = Tensor::empty({h}, dtype, category);
    if (c.moe.is_sparse_layer(l)) {
      lw.moe = allocate_moe_layer(c, dtype, category, sparse++);
    } else {
      lw.w_gate = Tensor::empty({f, h}, dtype, category);
      lw.w_up = Tensor::empty({f, h}, dtype, category);
      lw.w_down = Tensor::empty({h, f}, dtype, category);
      if (c.mlp_bias) {
        lw.b_gate = Tensor::empty({f}, dtype, category);
        lw.b_up = Tensor::empty({f}, dtype, category);
        lw.b_down = Tensor::empty({h}, dtype, category);
      }
    }
    w.layers.push_back(std::move(lw));
  }
  w.final_norm = Tensor::empty({h}, dtype, category);
  w.lm_head = w.tied ? w.embed : Tensor::empty({c.vocab_size, h}, dtype, category);
  return w;
}

void LlamaWeights::for_each(const std::function<void(const std::string&, Tensor&)>& fn) {
  fn("model.embed_tokens.weight", embed);
  for (size_t l = 0; l < layers.size(); ++l) {
    LayerWeights& lw = layers[l];
    const std::string p = fmt::format("model.layers.{}.", l);
    fn(p + "input_layernorm.weight", lw.attn_norm);
    fn(p + "self_attn.q_proj.weight", lw.wq);
    fn(p + "self_attn.k_proj.weight", lw.wk);
    fn(p + "self_attn.v_proj.weight", lw.wv);
    if (lw.bq.defined()) {
      fn(p + "self_attn.q_proj.bias", lw.bq);
      fn(p + "self_attn.k_proj.bias", lw.bk);
      fn(p + "self_attn.v_proj.bias", lw.bv);
    }
    fn(p + "self_attn.o_proj.weight", lw.wo);
    if (lw.bo.defined()) fn(p + "self_attn.o_proj.bias", lw.bo);
    if (lw.q_norm.defined()) {
      fn(p + "self_attn.q_norm.weight", lw.q_norm);
      fn(p + "self_attn.k_norm.weight", lw.k_norm);
    }
    fn(p + "post_attention_layernorm.weight", lw.mlp_norm);
    if (lw.moe.defined()) {
      for_each_moe_tensor(p, moe_family, lw.moe, fn);
      continue;
    }
    fn(p + "mlp.gate_proj.weight", lw.w_gate);
    if (lw.b_gate.defined()) fn(p + "mlp.gate_proj.bias", lw.b_gate);
    fn(p + "mlp.up_proj.weight", lw.w_up);
    if (lw.b_up.defined()) fn(p + "mlp.up_proj.bias", lw.b_up);
    fn(p + "mlp.down_proj.weight", lw.w_down);
    if (lw.b_down.defined()) fn(p + "mlp.down_proj.bias", lw.b_down);
  }
  fn("model.norm.weight", final_norm);
  if (!tied) fn("lm_head.weight", lm_head);
}

void LlamaWeights::for_each(const std::function<void(const std::string&, const Tensor&)>& fn) const {
  const_cast<LlamaWeights*>(this)->for_each([&](const std::string& name, Tensor& t) { fn(name, t); });
}

// Not a step path: global weights for assembly, verification and the single-rank reference.
void LlamaWeights::zero() {
  for_each([](const std::string&, Tensor& t) { t.zero(); });
}

double init_value(const InitOptions& o, const std::string& name, int64_t index) {
  return InitValues(o, name).at(index);
}

// Not a step path: initialization from the counter-based generator, made on the host and
// stored with one explicit copy per tensor (the weights may be device memory).
void init_weights(const InitOptions& o, LlamaWeights& weights) {
  weights.for_each([&](const std::string& name, Tensor& t) {
    const int64_t n = t.numel();
    const InitValues values(o, name);
    std::vector<std::byte> host(t.nbytes());
    if (t.dtype() == DType::kF64) {
      auto* p = reinterpret_cast<double*>(host.data());
      for (int64_t i = 0; i < n; ++i) p[i] = values.at(i);
    } else if (t.dtype() == DType::kBF16) {
      auto* p = reinterpret_cast<bf16*>(host.data());
      for (int64_t i = 0; i < n; ++i) p[i] = f32_to_bf16(static_cast<float>(values.at(i)));
    } else {
      FP_CHECK(t.dtype() == DType::kF32, "init of {}", t.describe());
      auto* p = reinterpret_cast<float*>(host.data());
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(values.at(i));
    }
    t.copy_from_host(host);
  });
}

}  // namespace foldpar
