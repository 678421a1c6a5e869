// Reading, writing and validating config.json.
#include "model/llama_config.h"

#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/rope_scaling_json.h"

namespace foldpar {
namespace {

// nlohmann parses iteratively, but dump() recurses: a hostile config nesting 100k levels
// deep would overflow the stack there. A valid config nests 2 levels.
constexpr int kMaxConfigDepth = 16;

// A value quoted into a message: its JSON, ASCII only, at most 100 bytes.
std::string quote(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', /*ensure_ascii=*/true);
  return s.size() <= 100 ? s : s.substr(0, 100) + "...";
}

Status read_int(const nlohmann::json& j, const char* key, bool required, int64_t* out) {
  auto it = j.find(key);
  if (it == j.end()) return required ? invalid_argument("config: missing \"{}\"", key) : Status();
  if (!it->is_number_integer()) return invalid_argument("config: \"{}\" must be an integer, got {}", key, quote(*it));
  *out = it->get<int64_t>();
  return Status();
}

Status read_double(const nlohmann::json& j, const char* key, double* out) {
  auto it = j.find(key);
  if (it == j.end()) return Status();
  if (!it->is_number()) return invalid_argument("config: \"{}\" must be a number, got {}", key, quote(*it));
  *out = it->get<double>();
  return Status();
}


// Fields of the Hugging Face configs that describe an architecture foldpar does not
// implement. Each is refused by name: loading such a file and ignoring the field would train
// or serve a different model than the checkpoint's without a word.
Status refuse_unimplemented(const nlohmann::json& j) {
  if (auto it = j.find("model_type"); it != j.end()) {
    if (!it->is_string()) return invalid_argument("config: \"model_type\" must be a string, got {}", quote(*it));
    const std::string t = it->get<std::string>();
    if (t == "qwen2_moe")
      return unimplemented("config: model_type \"{}\" has q/k/v biases, which foldpar's MoE layers do not implement",
                           t);
    if (t == "qwen3_moe")
      return unimplemented(
          "config: model_type \"{}\" has per-head q/k RMSNorm, which foldpar's MoE layers do not implement", t);
    if (t != "llama" && t != "mistral" && t != "mixtral" && t != "qwen2" && t != "qwen3")
      return unimplemented(
          "config: model_type {} is not supported (foldpar implements \"llama\", \"mistral\", \"mixtral\", "
          "\"qwen2\" and \"qwen3\")",
          quote(*it));
  }
  if (auto it = j.find("mlp_bias"); it != j.end() && !it->is_boolean())
    return invalid_argument("config: \"mlp_bias\" must be true or false, got {}", quote(*it));
  if (auto it = j.find("hidden_act"); it != j.end() && !(it->is_string() && it->get<std::string>() == "silu"))
    return unimplemented("config: hidden_act {} is not supported (foldpar implements \"silu\")", quote(*it));
  return Status();
}

// The sliding window as Hugging Face's modeling files apply it (transformers masking_utils:
// key j visible to query i iff i - W < j <= i). Mistral and Mixtral window every layer by
// "sliding_window" (null: none; absent: MistralConfig's default 4096, MixtralConfig's none).
// Qwen2 and Qwen3 window only with "use_sliding_window" true, and then only the layers from
// "max_window_layers" on (or those "layer_types" names "sliding_attention"): that per-layer
// rule is refused unless it leaves every layer full.
// Llama's modeling file never reads the key, so a window there is refused rather than guessed.
Status read_sliding_window(const nlohmann::json& j, const std::string& type, int64_t layers, int64_t* window) {
  auto it = j.find("sliding_window");
  const bool present = it != j.end() && !it->is_null();
  if (present && !it->is_number_integer())
    return invalid_argument("config: \"sliding_window\" must be an integer or null, got {}", quote(*it));
  if (type == "mistral" || type == "mixtral") {
    if (!present) {
      *window = it == j.end() && type == "mistral" ? 4096 : 0;
      return Status();
    }
    *window = it->get<int64_t>();
    if (*window <= 0) return invalid_argument("config: sliding_window ({}) must be positive or null", *window);
    return Status();
  }
  if (type == "qwen2" || type == "qwen3") {
    const auto use = j.find("use_sliding_window");
    if (use != j.end() && !use->is_boolean())
      return invalid_argument("config: \"use_sliding_window\" must be true or false, got {}", quote(*use));
    if (use == j.end() || !use->get<bool>() || !present) return Status();
    if (auto types = j.find("layer_types"); types != j.end()) {  // given, it replaces max_window_layers
      if (!types->is_array()) return invalid_argument("config: \"layer_types\" must be a list, got {}", quote(*types));
      for (const auto& t : *types)
        if (!(t.is_string() && t.get<std::string>() == "full_attention"))
          return unimplemented("config: layer_types entry {} with use_sliding_window true is not supported: foldpar "
                               "windows every layer or none",
                               quote(t));
      return Status();
    }
    int64_t first = 28;  // Qwen2Config's and Qwen3Config's default max_window_layers
    FP_RETURN_IF_ERROR(read_int(j, "max_window_layers", false, &first));
    if (first >= layers) return Status();  // no layer reaches the window
    return unimplemented(
        "config: use_sliding_window true with max_window_layers {} < num_hidden_layers {} (model_type \"{}\" windows "
        "layers {} on by sliding_window {}) is not supported: foldpar windows every layer or none",
        first, layers, type, first, quote(*it));
  }
  const auto use = j.find("use_sliding_window");  // false keeps a carried window off, as in Qwen's files
  if (present && !(use != j.end() && use->is_boolean() && !use->get<bool>()))
    return unimplemented(
        "config: sliding_window {} with model_type \"{}\" is not supported (Hugging Face's {} ignores it; a windowed "
        "model is model_type \"mistral\")",
        quote(*it), type, type);
  return Status();
}

// The attention variants the model type and "attention_bias" select, as Hugging Face's
// modeling files define them: Qwen2 always has q/k/v biases and no o_proj bias (its
// attention_bias field is not read); Llama's and Qwen3's attention_bias puts a bias on all
// four projections; Qwen3 always has the q/k norms. Mistral and Mixtral have no biases.
Status read_attention_variant(const nlohmann::json& j, LlamaConfig* c) {
  std::string type = "llama";
  if (auto it = j.find("model_type"); it != j.end()) type = it->get<std::string>();
  bool bias = false;
  if (auto it = j.find("attention_bias"); it != j.end()) {
    if (!it->is_boolean()) return invalid_argument("config: \"attention_bias\" must be true or false, got {}", quote(*it));
    bias = it->get<bool>();
  }
  // mlp_bias: Llama's MLP only (LlamaMLP reads it; Mistral's, Qwen's and the experts' do not).
  if (auto it = j.find("mlp_bias"); it != j.end() && it->get<bool>()) {
    if (type != "llama")
      return unimplemented("config: \"mlp_bias\" true is not supported with model_type \"{}\"", type);
    c->mlp_bias = true;
  }
  if (type == "qwen2") {
    c->qkv_bias = true;
    return Status();
  }
  if (bias && type != "llama" && type != "qwen3")
    return unimplemented("config: \"attention_bias\" true is not supported with model_type \"{}\"", type);
  c->qkv_bias = c->o_bias = bias;
  c->qk_norm = type == "qwen3";
  return Status();
}
}  // namespace

int64_t LlamaConfig::parameter_count() const {
  const int64_t h = hidden_size, f = intermediate_size;
  const int64_t per_layer = 2 * h + 2 * h * q_dim() + 2 * h * kv_dim() + 3 * h * f +
                            (qkv_bias ? q_dim() + 2 * kv_dim() : 0) + (o_bias ? h : 0) + (qk_norm ? 2 * head_dim() : 0) +
                            (mlp_bias ? 2 * f + h : 0);
  // A sparse layer has a router [E, h], E experts and the shared expert with its gate instead of the MLP.
  const int64_t shared = moe.shared_expert_intermediate_size;
  const int64_t moe_delta = moe.num_experts * h + moe.num_experts * 3 * h * moe.moe_intermediate_size +
                            (shared > 0 ? 3 * h * shared + h : 0) - 3 * h * f;
  return vocab_size * h * (tie_word_embeddings ? 1 : 2) + h + num_hidden_layers * per_layer +
         moe.sparse_layer_count(num_hidden_layers) * moe_delta;
}

Status LlamaConfig::validate() const {
  const std::pair<const char*, int64_t> positive[] = {
      {"hidden_size", hidden_size},         {"intermediate_size", intermediate_size},
      {"num_attention_heads", num_attention_heads}, {"num_key_value_heads", num_key_value_heads},
      {"num_hidden_layers", num_hidden_layers},     {"vocab_size", vocab_size},
      {"max_position_embeddings", max_position_embeddings}};
  for (const auto& [name, value] : positive)
    if (value <= 0) return invalid_argument("config: {} ({}) must be positive", name, value);
  if (explicit_head_dim < 0) return invalid_argument("config: head_dim ({}) must be positive", explicit_head_dim);
  if (explicit_head_dim == 0 && hidden_size % num_attention_heads != 0)
    return invalid_argument("config: hidden_size ({}) must be divisible by num_attention_heads ({})", hidden_size,
                            num_attention_heads);
  if (num_attention_heads % num_key_value_heads != 0)
    return invalid_argument("config: num_attention_heads ({}) must be divisible by num_key_value_heads ({})",
                            num_attention_heads, num_key_value_heads);
  if (head_dim() % 2 != 0) return invalid_argument("config: head dim ({}) must be even for RoPE", head_dim());
  if (vocab_size > std::numeric_limits<int32_t>::max())
    return invalid_argument("config: vocab_size ({}) does not fit 32-bit token ids", vocab_size);
  if (max_position_embeddings > std::numeric_limits<int32_t>::max())
    return invalid_argument("config: max_position_embeddings ({}) does not fit 32-bit positions",
                            max_position_embeddings);
  if (!(rms_norm_eps > 0)) return invalid_argument("config: rms_norm_eps ({}) must be positive", rms_norm_eps);
  if (!(rope_theta > 1)) return invalid_argument("config: rope_theta ({}) must be above 1", rope_theta);
  if (rope_scaling.type == RopeScaling::Type::kDynamic && head_dim() <= 2)
    return invalid_argument("config: dynamic rope_scaling needs head dim ({}) above 2", head_dim());
  if (o_bias && !qkv_bias) return invalid_argument("config: an o_proj bias without q/k/v biases has no Hugging Face form");
  if (sliding_window < 0) return invalid_argument("config: sliding_window ({}) must be 0 (off) or positive", sliding_window);
  if (sliding_window > 0 && (qkv_bias || qk_norm))
    return unimplemented("config: a sliding window with attention biases or q/k norms (qwen2, qwen3) is not implemented");
  if (moe.enabled() && (qkv_bias || qk_norm))
    return unimplemented("config: attention biases or q/k norms with experts are not implemented");
  if (mlp_bias && (moe.enabled() || qk_norm || sliding_window > 0 || (qkv_bias && !o_bias)))
    return unimplemented("config: MLP biases (mlp_bias) are Llama's: not with experts, q/k norms, a sliding window or "
                         "qwen2's q/k/v biases");
  return moe.validate(num_hidden_layers);
}

Result<LlamaConfig> LlamaConfig::from_json(const std::string& text) {
  bool too_deep = false;
  nlohmann::json j = nlohmann::json::parse(
      text,
      [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > kMaxConfigDepth) too_deep = true;
        return depth <= kMaxConfigDepth;  // deeper values are not even kept
      },
      /*allow_exceptions=*/false);
  if (too_deep) return invalid_argument("config: JSON nests deeper than {} levels", kMaxConfigDepth);
  if (j.is_discarded()) return invalid_argument("config: not valid JSON");
  if (!j.is_object()) return invalid_argument("config: top level must be a JSON object");
  LlamaConfig c;
  FP_RETURN_IF_ERROR(read_int(j, "hidden_size", true, &c.hidden_size));
  FP_RETURN_IF_ERROR(read_int(j, "intermediate_size", true, &c.intermediate_size));
  FP_RETURN_IF_ERROR(read_int(j, "num_attention_heads", true, &c.num_attention_heads));
  c.num_key_value_heads = c.num_attention_heads;  // Hugging Face default: MHA
  FP_RETURN_IF_ERROR(read_int(j, "num_key_value_heads", false, &c.num_key_value_heads));
  FP_RETURN_IF_ERROR(read_int(j, "num_hidden_layers", true, &c.num_hidden_layers));
  FP_RETURN_IF_ERROR(read_int(j, "vocab_size", true, &c.vocab_size));
  c.max_position_embeddings = 2048;
  FP_RETURN_IF_ERROR(read_int(j, "max_position_embeddings", false, &c.max_position_embeddings));
  FP_RETURN_IF_ERROR(read_double(j, "rms_norm_eps", &c.rms_norm_eps));
  FP_RETURN_IF_ERROR(read_double(j, "rope_theta", &c.rope_theta));
  if (auto it = j.find("tie_word_embeddings"); it != j.end()) {
    if (!it->is_boolean()) return invalid_argument("config: \"tie_word_embeddings\" must be true or false");
    c.tie_word_embeddings = it->get<bool>();
  }
  if (auto it = j.find("rope_scaling"); it != j.end()) {
    FP_ASSIGN_OR_RETURN(c.rope_scaling, read_rope_scaling(*it));
  }
  if (auto it = j.find("head_dim"); it != j.end() && !it->is_null()) {
    FP_RETURN_IF_ERROR(read_int(j, "head_dim", false, &c.explicit_head_dim));
    int64_t q_dim = 0;  // head_dim * n_h, which may overflow in a hostile file
    if (c.explicit_head_dim <= 0 || c.explicit_head_dim > (int64_t{1} << 20) ||
        __builtin_mul_overflow(c.explicit_head_dim, c.num_attention_heads, &q_dim))
      return invalid_argument("config: head_dim ({}) must be in [1, 2^20] with num_attention_heads ({})",
                              c.explicit_head_dim, c.num_attention_heads);
  }
  FP_RETURN_IF_ERROR(refuse_unimplemented(j));
  FP_RETURN_IF_ERROR(read_attention_variant(j, &c));
  {
    std::string type = "llama";
    if (auto it = j.find("model_type"); it != j.end()) type = it->get<std::string>();
    FP_RETURN_IF_ERROR(read_sliding_window(j, type, c.num_hidden_layers, &c.sliding_window));
  }
  MoeFamily family = MoeFamily::kMixtral;
  if (auto it = j.find("model_type"); it != j.end() && moe_family_of(it->get<std::string>(), &family)) {
    FP_ASSIGN_OR_RETURN(c.moe, MoeConfig::from_json(j, family));
    if (family == MoeFamily::kMixtral) c.moe.moe_intermediate_size = c.intermediate_size;
  }
  FP_RETURN_IF_ERROR(c.validate());
  return c;
}

Result<LlamaConfig> LlamaConfig::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found("config file {} cannot be opened", path);
  std::stringstream ss;
  ss << in.rdbuf();
  Result<LlamaConfig> c = from_json(ss.str());
  if (!c.ok()) return c.status().with_context(path);
  return c;
}

std::string LlamaConfig::to_json() const {
  nlohmann::ordered_json j;
  // The dense families by their attention variant (read_attention_variant's inverse).
  const bool qwen2 = qkv_bias && !o_bias && !qk_norm;
  const bool mistral = sliding_window > 0;  // validate() keeps the window off qwen2 and qwen3
  const char* dense_arch = qk_norm ? "Qwen3ForCausalLM"
                                   : (qwen2 ? "Qwen2ForCausalLM" : (mistral ? "MistralForCausalLM" : "LlamaForCausalLM"));
  const char* dense_type = qk_norm ? "qwen3" : (qwen2 ? "qwen2" : (mistral ? "mistral" : "llama"));
  j["architectures"] = {moe.enabled() ? moe.architecture() : dense_arch};
  j["model_type"] = moe.enabled() ? moe.model_type() : dense_type;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_attention_heads"] = num_attention_heads;
  if (explicit_head_dim > 0) j["head_dim"] = explicit_head_dim;
  j["num_key_value_heads"] = num_key_value_heads;
  j["num_hidden_layers"] = num_hidden_layers;
  j["vocab_size"] = vocab_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["rope_scaling"] = rope_scaling_json(rope_scaling);
  j["hidden_act"] = "silu";
  j["attention_bias"] = o_bias;
  if (mlp_bias) j["mlp_bias"] = true;
  if (qwen2) j["use_sliding_window"] = false;
  // Written always for the windowed families: a mistral file without the key means 4096.
  if (mistral || moe.enabled()) j["sliding_window"] = mistral ? nlohmann::ordered_json(sliding_window) : nullptr;
  j["torch_dtype"] = "float32";
  moe.to_json(j);
  return j.dump(2) + "\n";
}

}  // namespace foldpar
