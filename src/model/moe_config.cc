// Reading, writing and validating the MoE fields of config.json.
#include "model/moe_config.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

namespace foldpar {
namespace {

Status read_int(const nlohmann::json& j, const char* key, int64_t* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status();
  if (!it->is_number_integer()) return invalid_argument("config: \"{}\" must be an integer, got {}", key, it->dump());
  *out = it->get<int64_t>();
  return Status();
}

Status read_bool(const nlohmann::json& j, const char* key, bool* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status();
  if (!it->is_boolean()) return invalid_argument("config: \"{}\" must be true or false, got {}", key, it->dump());
  *out = it->get<bool>();
  return Status();
}

Status read_routing_keys(const nlohmann::json& j, MoeConfig& m) {
  FP_RETURN_IF_ERROR(read_int(j, "num_experts_per_tok", &m.num_experts_per_tok));
  if (auto it = j.find("router_aux_loss_coef"); it != j.end() && !it->is_null()) {
    if (!it->is_number())
      return invalid_argument("config: \"router_aux_loss_coef\" must be a number, got {}", it->dump());
    m.router_aux_loss_coef = it->get<double>();
  }
  FP_RETURN_IF_ERROR(read_bool(j, "output_router_logits", &m.output_router_logits));
  FP_RETURN_IF_ERROR(read_bool(j, "router_aux_loss_per_layer", &m.aux_per_layer));
  if (auto it = j.find("moe_capacity_factor"); it != j.end() && !it->is_null()) {
    if (!it->is_number())
      return invalid_argument("config: \"moe_capacity_factor\" must be a number, got {}", it->dump());
    m.capacity_factor = it->get<double>();
  }
  // Routers other than softmax-then-top-k are refused (e.g. DeepSeek's grouped or sigmoid
  // routers, which their configs name with these keys).
  // Mixtral's training-time jitter multiplies the router input by noise; foldpar routes exactly.
  if (auto it = j.find("router_jitter_noise");
      it != j.end() && !it->is_null() && !(it->is_number() && it->get<double>() == 0))
    return unimplemented("config: router_jitter_noise {} is not supported (foldpar's router has no noise)", it->dump());
  for (const char* key : {"router_type", "scoring_func", "topk_method", "n_group"})
    if (auto it = j.find(key); it != j.end() && !it->is_null())
      return unimplemented("config: router {} {} is not supported (foldpar routes by softmax then top-k)", key,
                           it->dump());
  return Status();
}

Status read_qwen_keys(const nlohmann::json& j, MoeConfig& m) {
  FP_RETURN_IF_ERROR(read_int(j, "num_experts", &m.num_experts));
  FP_RETURN_IF_ERROR(read_int(j, "moe_intermediate_size", &m.moe_intermediate_size));
  FP_RETURN_IF_ERROR(read_bool(j, "norm_topk_prob", &m.norm_topk_prob));
  FP_RETURN_IF_ERROR(read_int(j, "decoder_sparse_step", &m.decoder_sparse_step));
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return invalid_argument("config: \"mlp_only_layers\" must be a list, got {}", it->dump());
    for (const auto& v : *it) {
      if (!v.is_number_integer())
        return invalid_argument("config: \"mlp_only_layers\" must hold integers, got {}", v.dump());
      m.mlp_only_layers.push_back(v.get<int64_t>());
    }
  }
  if (m.family == MoeFamily::kQwen2) {
    FP_RETURN_IF_ERROR(read_int(j, "shared_expert_intermediate_size", &m.shared_expert_intermediate_size));
    return Status();
  }
  auto it = j.find("shared_expert_intermediate_size");
  if (it != j.end() && !it->is_null() && !(it->is_number_integer() && it->get<int64_t>() == 0))
    return unimplemented(
        "config: shared_expert_intermediate_size {} is a qwen2_moe key; qwen3_moe has no shared expert", it->dump());
  return Status();
}

}  // namespace

bool moe_family_of(const std::string& t, MoeFamily* family) {
  if (t == "mixtral") *family = MoeFamily::kMixtral;
  else if (t == "qwen2_moe") *family = MoeFamily::kQwen2;
  else if (t == "qwen3_moe") *family = MoeFamily::kQwen3;
  else return false;
  return true;
}

bool MoeConfig::is_sparse_layer(int64_t layer) const {
  if (!enabled()) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

int64_t MoeConfig::sparse_layer_count(int64_t layers) const {
  int64_t n = 0;
  for (int64_t l = 0; l < layers; ++l) n += is_sparse_layer(l) ? 1 : 0;
  return n;
}

const char* MoeConfig::model_type() const {
  switch (family) {
    case MoeFamily::kMixtral: return "mixtral";
    case MoeFamily::kQwen2: return "qwen2_moe";
    case MoeFamily::kQwen3: return "qwen3_moe";
  }
  return "mixtral";
}

const char* MoeConfig::architecture() const {
  switch (family) {
    case MoeFamily::kMixtral: return "MixtralForCausalLM";
    case MoeFamily::kQwen2: return "Qwen2MoeForCausalLM";
    case MoeFamily::kQwen3: return "Qwen3MoeForCausalLM";
  }
  return "MixtralForCausalLM";
}

Status MoeConfig::validate(int64_t layers) const {
  if (!enabled()) return Status();
  if (num_experts_per_tok < 1 || num_experts_per_tok > num_experts)
    return invalid_argument("config: num_experts_per_tok ({}) must be in [1, num_experts ({})]", num_experts_per_tok,
                            num_experts);
  if (moe_intermediate_size <= 0)
    return invalid_argument("config: moe_intermediate_size ({}) must be positive", moe_intermediate_size);
  if (shared_expert_intermediate_size < 0)
    return invalid_argument("config: shared_expert_intermediate_size ({}) must not be negative",
                            shared_expert_intermediate_size);
  if (decoder_sparse_step < 1)
    return invalid_argument("config: decoder_sparse_step ({}) must be at least 1", decoder_sparse_step);
  for (int64_t l : mlp_only_layers)
    if (l < 0 || l >= layers)
      return invalid_argument("config: mlp_only_layers entry {} outside the layers [0, {})", l, layers);
  if (family == MoeFamily::kMixtral && !norm_topk_prob)
    return invalid_argument("config: a mixtral model always renormalises its top-k weights (norm_topk_prob false)");
  if (!(router_aux_loss_coef >= 0))
    return invalid_argument("config: router_aux_loss_coef ({}) must not be negative", router_aux_loss_coef);
  if (!(capacity_factor >= 0 && capacity_factor <= 1e6))
    return invalid_argument("config: moe_capacity_factor ({}) must be in [0, 1e6] (0: dropless)", capacity_factor);
  return Status();
}

int64_t MoeConfig::expert_capacity(int64_t seq) const {
  if (!(capacity_factor > 0) || num_experts <= 0) return 0;
  return static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(seq * num_experts_per_tok) /
                                        static_cast<double>(num_experts)));
}

Result<MoeConfig> MoeConfig::from_json(const nlohmann::json& j, MoeFamily family) {
  MoeConfig m;
  m.family = family;
  FP_RETURN_IF_ERROR(read_routing_keys(j, m));
  if (family == MoeFamily::kMixtral) {
    FP_RETURN_IF_ERROR(read_int(j, "num_local_experts", &m.num_experts));
    m.norm_topk_prob = true;  // Mixtral's routing divides by the sum unconditionally
    // Mixtral's experts have the model's intermediate_size (filled in by LlamaConfig).
  } else {
    FP_RETURN_IF_ERROR(read_qwen_keys(j, m));
  }
  if (m.num_experts <= 0)
    return invalid_argument("config: a {} model needs a positive {} (got {})", m.model_type(),
                            family == MoeFamily::kMixtral ? "num_local_experts" : "num_experts", m.num_experts);
  return m;
}

void MoeConfig::to_json(nlohmann::ordered_json& j) const {
  if (!enabled()) return;
  if (family == MoeFamily::kMixtral) {
    j["num_local_experts"] = num_experts;
  } else {
    j["num_experts"] = num_experts;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["norm_topk_prob"] = norm_topk_prob;
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["mlp_only_layers"] = mlp_only_layers;
    if (family == MoeFamily::kQwen2) j["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
  }
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["router_aux_loss_coef"] = router_aux_loss_coef;
  j["output_router_logits"] = output_router_logits;
  if (aux_per_layer) j["router_aux_loss_per_layer"] = true;
  if (capacity_factor > 0) j["moe_capacity_factor"] = capacity_factor;
}

}  // namespace foldpar
