// MoeConfig: the mixture-of-experts fields of a Hugging Face config (Mixtral, Qwen2-MoE,
// Qwen3-MoE), kept apart from the attention-side fields of LlamaConfig. A config without
// experts (num_experts 0) is the dense Llama model; with them, every sparse layer's gated
// MLP is replaced by a router and E experts (model/moe_layer.h). Routing follows Hugging
// Face: softmax over E in f32 or wider, top k, ties to the lower index, optional
// renormalisation; dropless (every routed token is computed).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/status.h"

namespace foldpar {

// Which Hugging Face names and config keys a MoE model uses (model_type).
enum class MoeFamily {
  kMixtral,  // "mixtral": block_sparse_moe.gate, experts.j.w1/w3/w2; always renormalises
  kQwen2,    // "qwen2_moe": mlp.gate, mlp.experts.j.{gate,up,down}_proj, optional shared expert
  kQwen3,    // "qwen3_moe": as qwen2_moe without the shared expert
};

struct MoeConfig {
  int64_t num_experts = 0;                      // E; 0: a dense model (every other field unused)
  int64_t num_experts_per_tok = 0;              // k, 1 <= k <= E
  int64_t moe_intermediate_size = 0;            // f_e, each expert's gated-MLP width
  int64_t shared_expert_intermediate_size = 0;  // the shared expert's width; 0: none (Qwen2-MoE only)
  bool norm_topk_prob = false;                  // divide the k weights by their sum (Mixtral: always)
  int64_t decoder_sparse_step = 1;              // layer i is sparse iff (i + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;         // ... and i is not listed here (those are dense)
  double router_aux_loss_coef = 0.0;            // weight of the load-balancing loss in the loss
  bool output_router_logits = false;            // add coef * aux to the training loss (Hugging Face's switch)
  // foldpar's own key "router_aux_loss_per_layer": the aux loss summed over the sparse layers,
  // each of its own rows (Switch's form), instead of Hugging Face's over every layer's rows at once.
  bool aux_per_layer = false;
  // foldpar's own key "moe_capacity_factor" C (0: dropless, the default): each expert takes at
  // most ceil(C S k / E) of a sequence's S k token-expert pairs, earlier positions first (a
  // token's k choices in rank order); the pairs beyond it are dropped (they add nothing and
  // their routing weights get no gradient). The aux loss counts the choices before the drop.
  double capacity_factor = 0.0;
  MoeFamily family = MoeFamily::kMixtral;

  bool enabled() const { return num_experts > 0; }
  // The most pairs one expert takes from a sequence of `seq` tokens; 0: no limit (dropless).
  int64_t expert_capacity(int64_t seq) const;
  // Whether layer `layer` has experts (false for every layer of a dense model).
  bool is_sparse_layer(int64_t layer) const;
  int64_t sparse_layer_count(int64_t layers) const;
  // The Hugging Face model_type and architecture of the family.
  const char* model_type() const;
  const char* architecture() const;

  // Ranges: 1 <= k <= E, positive widths, step >= 1, listed layers in [0, layers); messages
  // name the values.
  Status validate(int64_t num_hidden_layers) const;
  // Reads the family's keys from a config object (model_type already checked to be a MoE
  // family); a key of another family is refused by name rather than ignored.
  static Result<MoeConfig> from_json(const nlohmann::json& j, MoeFamily family);
  void to_json(nlohmann::ordered_json& j) const;
};

// The MoE family of a model_type, or false for a dense type.
bool moe_family_of(const std::string& model_type, MoeFamily* family);

}  // namespace foldpar
