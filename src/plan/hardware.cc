// Hardware descriptions: JSON in and out, with the ranges checked.
#include "plan/hardware.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string_view>

namespace foldpar {

namespace {

// Linear in log(x) between the points of `t` (x strictly increasing), the nearest point outside.
template <typename Point, typename X, typename Y>
double interpolate_log(const std::vector<Point>& t, double x, X xs, Y ys) {
  if (x <= xs(t.front())) return ys(t.front());
  if (x >= xs(t.back())) return ys(t.back());
  size_t i = 1;
  while (xs(t[i]) < x) ++i;
  const double w = std::log(x / xs(t[i - 1])) / std::log(xs(t[i]) / xs(t[i - 1]));
  return ys(t[i - 1]) + w * (ys(t[i]) - ys(t[i - 1]));
}

}  // namespace

double Hardware::gemm_efficiency(double min_dim) const {
  if (gemm_efficiency_by_min_dim.empty()) return matmul_efficiency;
  return interpolate_log(gemm_efficiency_by_min_dim, min_dim, [](const auto& p) { return p.first; },
                         [](const auto& p) { return p.second; });
}

double Hardware::attention_fwd_rate(double seq_k) const {
  if (attention_efficiency_by_seq.empty()) return attention_fwd_rate();
  return interpolate_log(attention_efficiency_by_seq, std::max(seq_k, 1.0), [](const AttentionPoint& p) { return p.seq_k; },
                         [](const AttentionPoint& p) { return p.forward; });
}

double Hardware::attention_bwd_rate(double seq_k) const {
  if (attention_efficiency_by_seq.empty()) return attention_bwd_rate();
  return interpolate_log(attention_efficiency_by_seq, std::max(seq_k, 1.0), [](const AttentionPoint& p) { return p.seq_k; },
                         [](const AttentionPoint& p) { return p.backward; });
}

double Hardware::collective_efficiency_of(const std::string& kind) const {
  for (const auto& [k, e] : collective_efficiency)
    if (k == kind) return e;
  return 1.0;
}

double Hardware::tokenwise_gb_per_s(std::string_view op) const {
  for (const auto& [listed, rate] : tokenwise_gb_per_s_by_op)
    if (listed == op) return rate;
  return memory_gb_per_s;
}

double Hardware::table_gb_per_s(bool intra_node, const std::string& kind, double bytes) const {
  for (const auto& [k, points] : intra_node ? intra_node_gb_per_s_by_bytes : inter_node_gb_per_s_by_bytes)
    if (k == kind && !points.empty())
      return interpolate_log(points, std::max(bytes, 1.0), [](const SizePoint& p) { return p.bytes; },
                             [](const SizePoint& p) { return p.gb_per_s; });
  return 0;
}

namespace {

constexpr const char* kCollectiveKinds[] = {"broadcast", "reduce",     "all_reduce", "all_gather", "reduce_scatter",
                                            "all_to_all", "send",      "recv",       "send_recv",  "barrier"};

bool known_kind(const std::string& kind) {
  for (const char* k : kCollectiveKinds)
    if (kind == k) return true;
  return false;
}

// A size table's key: a kind, or "i" + a kind (its non-blocking form).
bool known_table_kind(const std::string& key) { return known_kind(key) || (key.starts_with("i") && known_kind(key.substr(1))); }

// A link class's rates by message size: known kinds, each once, bytes at least 1 and
// increasing, rates positive.
Status validate_size_tables(const std::string& name, const char* field, const Hardware::SizeTables& tables) {
  for (size_t t = 0; t < tables.size(); ++t) {
    const auto& [kind, points] = tables[t];
    if (!known_table_kind(kind)) return invalid_argument("hardware '{}': {} names an unknown kind '{}'", name, field, kind);
    for (size_t u = 0; u < t; ++u)
      if (tables[u].first == kind) return invalid_argument("hardware '{}': {} gives '{}' twice", name, field, kind);
    if (points.empty()) return invalid_argument("hardware '{}': {} '{}' has no points", name, field, kind);
    for (size_t i = 0; i < points.size(); ++i) {
      if (!(points[i].bytes >= 1))
        return invalid_argument("hardware '{}': {} '{}'[{}] bytes ({}) must be at least 1", name, field, kind, i, points[i].bytes);
      if (!(points[i].gb_per_s > 0 && std::isfinite(points[i].gb_per_s)))
        return invalid_argument("hardware '{}': {} '{}'[{}] GB/s ({}) must be positive", name, field, kind, i, points[i].gb_per_s);
      if (i > 0 && !(points[i].bytes > points[i - 1].bytes))
        return invalid_argument("hardware '{}': {} '{}' bytes must increase ({} after {})", name, field, kind, points[i].bytes,
                                points[i - 1].bytes);
    }
  }
  return Status();
}

// The finer fields (hardware.h): the GEMM table, attention and link figures.
// The file keeps these maps as JSON objects: a name given twice would lose one value.
Status no_repeated_names(const std::string& hardware, const char* field,
                         const std::vector<std::pair<std::string, double>>& entries) {
  std::set<std::string_view> names;
  for (const auto& [key, value] : entries)
    if (!names.insert(key).second)
      return invalid_argument("hardware '{}': {} holds '{}' twice (the names must differ)", hardware, field, key);
  return Status();
}

Status validate_fine_fields(const Hardware& h) {
  const auto& t = h.gemm_efficiency_by_min_dim;
  for (size_t i = 0; i < t.size(); ++i) {
    if (!(t[i].first >= 1))
      return invalid_argument("hardware '{}': gemm_efficiency_by_min_dim[{}] min_dim ({}) must be at least 1", h.name, i,
                              t[i].first);
    if (!(t[i].second > 0 && t[i].second <= 1))
      return invalid_argument("hardware '{}': gemm_efficiency_by_min_dim[{}] efficiency ({}) must lie in (0, 1]", h.name, i,
                              t[i].second);
    if (i > 0 && !(t[i].first > t[i - 1].first))
      return invalid_argument("hardware '{}': gemm_efficiency_by_min_dim min_dim must increase ({} after {})", h.name,
                              t[i].first, t[i - 1].first);
  }
  const auto& a = h.attention_efficiency_by_seq;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(a[i].seq_k >= 1))
      return invalid_argument("hardware '{}': attention_efficiency_by_seq[{}] seq_k ({}) must be at least 1", h.name, i,
                              a[i].seq_k);
    if (!(a[i].forward > 0 && a[i].forward <= 1 && a[i].backward > 0 && a[i].backward <= 1))
      return invalid_argument("hardware '{}': attention_efficiency_by_seq[{}] efficiencies ({}, {}) must lie in (0, 1]",
                              h.name, i, a[i].forward, a[i].backward);
    if (i > 0 && !(a[i].seq_k > a[i - 1].seq_k))
      return invalid_argument("hardware '{}': attention_efficiency_by_seq seq_k must increase ({} after {})", h.name,
                              a[i].seq_k, a[i - 1].seq_k);
  }
  const std::pair<const char*, double> fractions[] = {{"attention_fwd_efficiency", h.attention_fwd_efficiency},
                                                      {"attention_bwd_efficiency", h.attention_bwd_efficiency}};
  for (const auto& [field, v] : fractions)
    if (!(v >= 0 && v <= 1)) return invalid_argument("hardware '{}': {} ({}) must lie in (0, 1], or be 0 (unknown)", h.name, field, v);
  const std::pair<const char*, double> latencies[] = {{"intra_node_latency_s", h.intra_node_latency_s},
                                                      {"inter_node_latency_s", h.inter_node_latency_s}};
  for (const auto& [field, v] : latencies)
    if (!(v >= 0 && v < 1)) return invalid_argument("hardware '{}': {} ({}) must lie in [0, 1) seconds", h.name, field, v);
  const std::pair<const char*, int> slots[] = {{"intra_node_concurrency", h.intra_node_concurrency},
                                               {"inter_node_concurrency", h.inter_node_concurrency}};
  for (const auto& [field, v] : slots)
    if (v < 1) return invalid_argument("hardware '{}': {} ({}) must be at least 1", h.name, field, v);
  const std::pair<const char*, double> shares[] = {{"intra_node_copy_share", h.intra_node_copy_share},
                                                   {"inter_node_copy_share", h.inter_node_copy_share}};
  for (const auto& [field, v] : shares)
    if (!(v >= 0 && v <= Hardware::kMaxCopyShare))
      return invalid_argument("hardware '{}': {} ({}) must lie in [0, {}]", h.name, field, v, Hardware::kMaxCopyShare);
  for (const auto& [kind, e] : h.collective_efficiency) {
    if (!known_kind(kind)) return invalid_argument("hardware '{}': collective_efficiency names an unknown kind '{}'", h.name, kind);
    if (!(e > 0 && e <= 1)) return invalid_argument("hardware '{}': collective_efficiency '{}' ({}) must lie in (0, 1]", h.name, kind, e);
  }
  FP_RETURN_IF_ERROR(no_repeated_names(h.name, "tokenwise_gb_per_s_by_op", h.tokenwise_gb_per_s_by_op));
  for (const auto& [op, rate] : h.tokenwise_gb_per_s_by_op)
    if (!(rate > 0)) return invalid_argument("hardware '{}': tokenwise_gb_per_s_by_op '{}' ({}) must be positive", h.name, op, rate);
  FP_RETURN_IF_ERROR(validate_size_tables(h.name, "intra_node_gb_per_s_by_bytes", h.intra_node_gb_per_s_by_bytes));
  return validate_size_tables(h.name, "inter_node_gb_per_s_by_bytes", h.inter_node_gb_per_s_by_bytes);
}

Status parse_gemm_table(const nlohmann::json& j, Hardware& h) {
  const char* const key = "gemm_efficiency_by_min_dim";
  if (!j.contains(key)) return Status();
  if (!j[key].is_array()) return invalid_argument("hardware '{}': field '{}' must be an array of [min_dim, efficiency]", h.name, key);
  for (size_t i = 0; i < j[key].size(); ++i) {
    const nlohmann::json& p = j[key][i];
    if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number())
      return invalid_argument("hardware '{}': {}[{}] must be [min_dim, efficiency], got {}", h.name, key, i, p.dump());
    h.gemm_efficiency_by_min_dim.emplace_back(p[0].get<double>(), p[1].get<double>());
  }
  return Status();
}

Status parse_attention_table(const nlohmann::json& j, Hardware& h) {
  const char* const key = "attention_efficiency_by_seq";
  if (!j.contains(key)) return Status();
  if (!j[key].is_array())
    return invalid_argument("hardware '{}': field '{}' must be an array of [seq_k, forward, backward]", h.name, key);
  for (size_t i = 0; i < j[key].size(); ++i) {
    const nlohmann::json& p = j[key][i];
    if (!p.is_array() || p.size() != 3 || !p[0].is_number() || !p[1].is_number() || !p[2].is_number())
      return invalid_argument("hardware '{}': {}[{}] must be [seq_k, forward, backward], got {}", h.name, key, i, p.dump());
    h.attention_efficiency_by_seq.push_back({p[0].get<double>(), p[1].get<double>(), p[2].get<double>()});
  }
  return Status();
}

// {"kind": [[bytes, GB/s], ...], ...} (read in key order); the ranges are validate()'s.
Status parse_size_tables(const nlohmann::json& j, const char* field, const std::string& name, Hardware::SizeTables& out) {
  if (!j.contains(field)) return Status();
  if (!j[field].is_object())
    return invalid_argument("hardware '{}': field '{}' must be an object of kind: [[bytes, GB/s], ...]", name, field);
  for (const auto& [kind, points] : j[field].items()) {
    if (!points.is_array()) return invalid_argument("hardware '{}': {} '{}' must be an array of [bytes, GB/s]", name, field, kind);
    std::vector<Hardware::SizePoint> table;
    for (size_t i = 0; i < points.size(); ++i) {
      const nlohmann::json& p = points[i];
      if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number())
        return invalid_argument("hardware '{}': {} '{}'[{}] must be [bytes, GB/s], got {}", name, field, kind, i, p.dump());
      table.push_back({p[0].get<double>(), p[1].get<double>()});
    }
    out.emplace_back(kind, std::move(table));
  }
  return Status();
}

// An object of numbers, e.g. "measured" or "collective_efficiency" (read in key order).
Status parse_number_map(const nlohmann::json& j, const char* field, const std::string& name,
                        std::vector<std::pair<std::string, double>>& out) {
  if (!j.contains(field)) return Status();
  if (!j[field].is_object()) return invalid_argument("hardware '{}': field '{}' must be an object of numbers", name, field);
  for (const auto& [key, value] : j[field].items()) {
    if (!value.is_number()) return invalid_argument("hardware '{}': {} '{}' must be a number", name, field, key);
    out.emplace_back(key, value.get<double>());
  }
  return Status();
}

}  // namespace

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
  FP_RETURN_IF_ERROR(no_repeated_names(name, "measured", measured));
  return validate_fine_fields(*this);
}

Result<Hardware> Hardware::from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument("hardware description is not a JSON object");
  static const char* const kKnown[] = {"name", "devices_per_node", "memory_per_device_gb", "peak_tflops_bf16",
                                       "peak_tflops_f32", "intra_node_gb_per_s", "inter_node_gb_per_s",
                                       "memory_gb_per_s", "matmul_efficiency", "attention_efficiency", "overlap_efficiency", "notes",
                                       "measured", "gemm_efficiency_by_min_dim", "attention_fwd_efficiency",
                                       "attention_bwd_efficiency", "intra_node_latency_s", "inter_node_latency_s",
                                       "intra_node_concurrency", "inter_node_concurrency", "collective_efficiency",
                                       "attention_efficiency_by_seq", "intra_node_copy_share", "inter_node_copy_share",
                                       "intra_node_gb_per_s_by_bytes", "inter_node_gb_per_s_by_bytes",
                                       "tokenwise_gb_per_s_by_op"};
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
  FP_RETURN_IF_ERROR(number("attention_fwd_efficiency", h.attention_fwd_efficiency, false));
  FP_RETURN_IF_ERROR(number("attention_bwd_efficiency", h.attention_bwd_efficiency, false));
  FP_RETURN_IF_ERROR(number("intra_node_latency_s", h.intra_node_latency_s, false));
  FP_RETURN_IF_ERROR(number("inter_node_latency_s", h.inter_node_latency_s, false));
  FP_RETURN_IF_ERROR(number("intra_node_copy_share", h.intra_node_copy_share, false));
  FP_RETURN_IF_ERROR(number("inter_node_copy_share", h.inter_node_copy_share, false));
  auto integer = [&](const char* key, int& out) -> Status {
    double v = out;
    FP_RETURN_IF_ERROR(number(key, v, false));
    if (v != std::floor(v) || std::abs(v) > 1e6) return invalid_argument("hardware '{}': {} ({}) must be an integer", h.name, key, v);
    out = static_cast<int>(v);
    return Status();
  };
  FP_RETURN_IF_ERROR(integer("intra_node_concurrency", h.intra_node_concurrency));
  FP_RETURN_IF_ERROR(integer("inter_node_concurrency", h.inter_node_concurrency));
  FP_RETURN_IF_ERROR(parse_gemm_table(j, h));
  FP_RETURN_IF_ERROR(parse_attention_table(j, h));
  FP_RETURN_IF_ERROR(parse_number_map(j, "measured", h.name, h.measured));
  FP_RETURN_IF_ERROR(parse_number_map(j, "collective_efficiency", h.name, h.collective_efficiency));
  FP_RETURN_IF_ERROR(parse_number_map(j, "tokenwise_gb_per_s_by_op", h.name, h.tokenwise_gb_per_s_by_op));
  FP_RETURN_IF_ERROR(parse_size_tables(j, "intra_node_gb_per_s_by_bytes", h.name, h.intra_node_gb_per_s_by_bytes));
  FP_RETURN_IF_ERROR(parse_size_tables(j, "inter_node_gb_per_s_by_bytes", h.name, h.inter_node_gb_per_s_by_bytes));
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
  if (!gemm_efficiency_by_min_dim.empty()) {
    j["gemm_efficiency_by_min_dim"] = nlohmann::ordered_json::array();
    for (const auto& [dim, eff] : gemm_efficiency_by_min_dim) j["gemm_efficiency_by_min_dim"].push_back({dim, eff});
  }
  if (attention_fwd_efficiency > 0) j["attention_fwd_efficiency"] = attention_fwd_efficiency;
  if (attention_bwd_efficiency > 0) j["attention_bwd_efficiency"] = attention_bwd_efficiency;
  if (!attention_efficiency_by_seq.empty()) {
    j["attention_efficiency_by_seq"] = nlohmann::ordered_json::array();
    for (const AttentionPoint& p : attention_efficiency_by_seq)
      j["attention_efficiency_by_seq"].push_back({p.seq_k, p.forward, p.backward});
  }
  j["intra_node_latency_s"] = intra_node_latency_s;
  j["inter_node_latency_s"] = inter_node_latency_s;
  j["intra_node_concurrency"] = intra_node_concurrency;
  j["inter_node_concurrency"] = inter_node_concurrency;
  if (intra_node_copy_share > 0) j["intra_node_copy_share"] = intra_node_copy_share;
  if (inter_node_copy_share > 0) j["inter_node_copy_share"] = inter_node_copy_share;
  if (!collective_efficiency.empty()) {
    j["collective_efficiency"] = nlohmann::ordered_json::object();
    for (const auto& [kind, e] : collective_efficiency) j["collective_efficiency"][kind] = e;
  }
  if (!tokenwise_gb_per_s_by_op.empty()) {
    j["tokenwise_gb_per_s_by_op"] = nlohmann::ordered_json::object();
    for (const auto& [op, rate] : tokenwise_gb_per_s_by_op) j["tokenwise_gb_per_s_by_op"][op] = rate;
  }
  const std::pair<const char*, const SizeTables*> tables[] = {{"intra_node_gb_per_s_by_bytes", &intra_node_gb_per_s_by_bytes},
                                                               {"inter_node_gb_per_s_by_bytes", &inter_node_gb_per_s_by_bytes}};
  for (const auto& [field, t] : tables) {
    if (t->empty()) continue;
    j[field] = nlohmann::ordered_json::object();
    for (const auto& [kind, points] : *t) {
      j[field][kind] = nlohmann::ordered_json::array();
      for (const SizePoint& p : points) j[field][kind].push_back({p.bytes, p.gb_per_s});
    }
  }
  j["notes"] = notes;
  if (!measured.empty()) {
    j["measured"] = nlohmann::ordered_json::object();
    for (const auto& [key, value] : measured) j["measured"][key] = value;
  }
  return j.dump(2) + "\n";
}

}  // namespace foldpar
