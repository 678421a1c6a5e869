// Hardware descriptions: JSON in and out, with the ranges checked.
#include "plan/hardware.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace foldpar {

Status Hardware::validate() const {
  if (devices_per_node < 1) return invalid_argument("hardware '{}': devices_per_node ({}) must be at least 1", name, devices_per_node);
  const std::pair<const char*, double> positive[] = {{"memory_per_device_gb", memory_per_device_gb},
                                                     {"peak_tflops_f32", peak_tflops_f32},
                                                     {"intra_node_gb_per_s", intra_node_gb_per_s},
                                                     {"inter_node_gb_per_s", inter_node_gb_per_s}};
  for (const auto& [field, v] : positive)
    if (!(v > 0)) return invalid_argument("hardware '{}': {} ({}) must be positive", name, field, v);
  if (peak_tflops_bf16 < 0 || memory_gb_per_s < 0)
    return invalid_argument("hardware '{}': peak_tflops_bf16 ({}) and memory_gb_per_s ({}) must not be negative", name,
                            peak_tflops_bf16, memory_gb_per_s);
  if (!(matmul_efficiency > 0 && matmul_efficiency <= 1))
    return invalid_argument("hardware '{}': matmul_efficiency ({}) must lie in (0, 1]", name, matmul_efficiency);
  if (!(attention_efficiency >= 0 && attention_efficiency <= 1))
    return invalid_argument("hardware '{}': attention_efficiency ({}) must lie in (0, 1], or be 0 (as matmul_efficiency)",
                            name, attention_efficiency);
  if (!(overlap_efficiency >= 0 && overlap_efficiency <= 1))
    return invalid_argument("hardware '{}': overlap_efficiency ({}) must lie in [0, 1]", name, overlap_efficiency);
  return Status();
}

Result<Hardware> Hardware::from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument("hardware description is not a JSON object");
  static const char* const kKnown[] = {"name", "devices_per_node", "memory_per_device_gb", "peak_tflops_bf16",
                                       "peak_tflops_f32", "intra_node_gb_per_s", "inter_node_gb_per_s",
                                       "memory_gb_per_s", "matmul_efficiency", "attention_efficiency", "overlap_efficiency", "notes",
                                       "measured"};
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    for (const char* k : kKnown) known = known || key == k;
    if (!known) return invalid_argument("hardware description: unknown field '{}'", key);
  }
  Hardware h;
  h.name = j.value("name", std::string("unnamed"));
  auto number = [&](const char* key, double& out, bool required) -> Status {
    if (!j.contains(key)) {
      if (required) return invalid_argument("hardware '{}': missing field '{}'", h.name, key);
      return Status();
    }
    if (!j[key].is_number()) return invalid_argument("hardware '{}': field '{}' must be a number", h.name, key);
    out = j[key].get<double>();
    return Status();
  };
  double devices = 0;
  FP_RETURN_IF_ERROR(number("devices_per_node", devices, true));
  if (devices != static_cast<double>(static_cast<int>(devices)))
    return invalid_argument("hardware '{}': devices_per_node ({}) must be an integer", h.name, devices);
  h.devices_per_node = static_cast<int>(devices);
  FP_RETURN_IF_ERROR(number("memory_per_device_gb", h.memory_per_device_gb, true));
  FP_RETURN_IF_ERROR(number("peak_tflops_f32", h.peak_tflops_f32, true));
  FP_RETURN_IF_ERROR(number("peak_tflops_bf16", h.peak_tflops_bf16, false));
  FP_RETURN_IF_ERROR(number("intra_node_gb_per_s", h.intra_node_gb_per_s, true));
  FP_RETURN_IF_ERROR(number("inter_node_gb_per_s", h.inter_node_gb_per_s, true));
  FP_RETURN_IF_ERROR(number("memory_gb_per_s", h.memory_gb_per_s, false));
  FP_RETURN_IF_ERROR(number("matmul_efficiency", h.matmul_efficiency, false));
  FP_RETURN_IF_ERROR(number("attention_efficiency", h.attention_efficiency, false));
  FP_RETURN_IF_ERROR(number("overlap_efficiency", h.overlap_efficiency, false));
  if (j.contains("notes")) {
    if (!j["notes"].is_string()) return invalid_argument("hardware '{}': field 'notes' must be a string", h.name);
    h.notes = j["notes"].get<std::string>();
  }
  FP_RETURN_IF_ERROR(h.validate());
  return h;
}

Result<Hardware> Hardware::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found("cannot read hardware description '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  Result<Hardware> h = from_json(ss.str());
  if (!h.ok()) return h.status().with_context(path);
  return h;
}

std::string Hardware::to_json() const {
  nlohmann::ordered_json j;
  j["name"] = name;
  j["devices_per_node"] = devices_per_node;
  j["memory_per_device_gb"] = memory_per_device_gb;
  j["peak_tflops_bf16"] = peak_tflops_bf16;
  j["peak_tflops_f32"] = peak_tflops_f32;
  j["intra_node_gb_per_s"] = intra_node_gb_per_s;
  j["inter_node_gb_per_s"] = inter_node_gb_per_s;
  j["memory_gb_per_s"] = memory_gb_per_s;
  j["matmul_efficiency"] = matmul_efficiency;
  if (attention_efficiency > 0) j["attention_efficiency"] = attention_efficiency;
  j["overlap_efficiency"] = overlap_efficiency;
  j["notes"] = notes;
  return j.dump(2) + "\n";
}

}  // namespace foldpar
