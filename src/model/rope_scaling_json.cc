// config.json "rope_scaling" <-> RopeScaling. The field names and which type reads which
// are Hugging Face transformers' (modeling_rope_utils); anything else is refused by name.
#include "model/rope_scaling_json.h"

#include <set>
#include <string>

namespace foldpar {
namespace {

using Type = RopeScaling::Type;

std::string quote(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', /*ensure_ascii=*/true);
  return s.size() <= 100 ? s : s.substr(0, 100) + "...";
}

Status read_number(const nlohmann::json& o, const char* key, bool required, double* out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null())
    return required ? invalid_argument("config: rope_scaling is missing \"{}\"", key) : Status();
  if (!it->is_number() || it->is_boolean())
    return invalid_argument("config: rope_scaling \"{}\" must be a number, got {}", key, quote(*it));
  *out = it->get<double>();
  return Status();
}

// The keys each type reads (Hugging Face's per-type validation lists).
const std::set<std::string>& known_keys(Type t) {
  static const std::set<std::string> none = {"rope_type", "type"};
  static const std::set<std::string> factor = {"rope_type", "type", "factor"};
  static const std::set<std::string> llama3 = {"rope_type",       "type",           "factor",
                                               "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};
  static const std::set<std::string> yarn = {"rope_type", "type",   "factor",         "original_max_position_embeddings",
                                             "beta_fast", "beta_slow", "attention_factor", "mscale",
                                             "mscale_all_dim", "truncate"};
  switch (t) {
    case Type::kDefault: return none;
    case Type::kLinear:
    case Type::kDynamic: return factor;
    case Type::kLlama3: return llama3;
    case Type::kYarn: return yarn;
  }
  return none;
}

Result<Type> read_type(const nlohmann::json& o) {
  auto it = o.find("rope_type");
  if (it == o.end()) it = o.find("type");
  if (it == o.end()) return invalid_argument("config: rope_scaling has no \"rope_type\" (or \"type\")");
  if (!it->is_string()) return invalid_argument("config: rope_scaling type must be a string, got {}", quote(*it));
  const std::string name = it->get<std::string>();
  for (Type t : {Type::kDefault, Type::kLinear, Type::kDynamic, Type::kLlama3, Type::kYarn})
    if (name == rope_type_name(t)) return t;
  return unimplemented(
      "config: rope_scaling type {} is not supported (foldpar implements default, linear, dynamic, llama3, yarn)",
      quote(*it));
}

Status read_yarn(const nlohmann::json& o, RopeScaling& s) {
  FP_RETURN_IF_ERROR(read_number(o, "beta_fast", false, &s.beta_fast));
  FP_RETURN_IF_ERROR(read_number(o, "beta_slow", false, &s.beta_slow));
  FP_RETURN_IF_ERROR(read_number(o, "attention_factor", false, &s.attention_factor));
  FP_RETURN_IF_ERROR(read_number(o, "mscale", false, &s.mscale));
  FP_RETURN_IF_ERROR(read_number(o, "mscale_all_dim", false, &s.mscale_all_dim));
  if (auto it = o.find("truncate"); it != o.end()) {
    if (!it->is_boolean()) return invalid_argument("config: rope_scaling \"truncate\" must be true or false");
    s.truncate = it->get<bool>();
  }
  if (!(s.beta_fast > 0) || !(s.beta_slow > 0))
    return invalid_argument("config: rope_scaling beta_fast ({}) and beta_slow ({}) must be positive", s.beta_fast,
                            s.beta_slow);
  if (s.attention_factor < 0)
    return invalid_argument("config: rope_scaling attention_factor ({}) must be positive", s.attention_factor);
  return Status();
}

}  // namespace

Result<RopeScaling> read_rope_scaling(const nlohmann::json& value) {
  RopeScaling s;
  if (value.is_null()) return s;
  if (!value.is_object()) return invalid_argument("config: rope_scaling must be an object or null, got {}", quote(value));
  FP_ASSIGN_OR_RETURN(s.type, read_type(value));
  for (const auto& [key, v] : value.items())
    if (!known_keys(s.type).contains(key))
      return unimplemented("config: rope_scaling field \"{}\" is not supported for type {}", key,
                           rope_type_name(s.type));
  if (!s.enabled()) return s;
  FP_RETURN_IF_ERROR(read_number(value, "factor", true, &s.factor));
  if (!(s.factor > 0)) return invalid_argument("config: rope_scaling factor ({}) must be positive", s.factor);
  double original = 0;
  FP_RETURN_IF_ERROR(read_number(value, "original_max_position_embeddings", s.type == Type::kLlama3, &original));
  if (original < 0 || original != static_cast<double>(static_cast<int64_t>(original)))
    return invalid_argument("config: rope_scaling original_max_position_embeddings ({}) must be a positive integer",
                            original);
  s.original_max_position_embeddings = static_cast<int64_t>(original);
  if (s.type == Type::kLlama3) {
    FP_RETURN_IF_ERROR(read_number(value, "low_freq_factor", true, &s.low_freq_factor));
    FP_RETURN_IF_ERROR(read_number(value, "high_freq_factor", true, &s.high_freq_factor));
    if (!(s.low_freq_factor > 0) || !(s.high_freq_factor > s.low_freq_factor) || original <= 0)
      return invalid_argument(
          "config: rope_scaling llama3 needs 0 < low_freq_factor ({}) < high_freq_factor ({}) and "
          "original_max_position_embeddings ({}) > 0",
          s.low_freq_factor, s.high_freq_factor, original);
  }
  if (s.type == Type::kYarn) FP_RETURN_IF_ERROR(read_yarn(value, s));
  return s;
}

nlohmann::ordered_json rope_scaling_json(const RopeScaling& s) {
  if (!s.enabled()) return nullptr;
  nlohmann::ordered_json j;
  j["rope_type"] = rope_type_name(s.type);
  j["factor"] = s.factor;
  if (s.type == Type::kLlama3) {
    j["low_freq_factor"] = s.low_freq_factor;
    j["high_freq_factor"] = s.high_freq_factor;
  }
  if ((s.type == Type::kLlama3 || s.type == Type::kYarn) && s.original_max_position_embeddings > 0)
    j["original_max_position_embeddings"] = s.original_max_position_embeddings;
  if (s.type == Type::kYarn) {
    j["beta_fast"] = s.beta_fast;
    j["beta_slow"] = s.beta_slow;
    if (s.attention_factor > 0) j["attention_factor"] = s.attention_factor;
    if (s.mscale != 0) j["mscale"] = s.mscale;
    if (s.mscale_all_dim != 0) j["mscale_all_dim"] = s.mscale_all_dim;
    j["truncate"] = s.truncate;
  }
  return j;
}

}  // namespace foldpar
