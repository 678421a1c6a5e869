// Parsing layout specs ("dp=2+tp=2+sp=2:ring") and writing them back.
#include "plan/layout_spec.h"

#include <charconv>
#include <sstream>

namespace foldpar {
namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);) out.push_back(item);
  return out;
}

Result<int> parse_degree(const std::string& text, const std::string& what) {
  int v = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || ptr != end || v < 1)
    return invalid_argument("layout '{}': the degree '{}' must be a positive integer", what, text);
  return v;
}

Status apply_option(const std::string& opt, const std::string& spec, LayoutSpec& s) {
  if (opt == "ring") s.ring = true;
  else if (opt == "seqpar") s.sequence_parallel = true;
  else if (opt == "nooverlap") s.overlap = false;
  else if (opt == "keepw") s.keep_weights = true;
  else if (opt == "keepkv") s.keep_kv = true;
  else if (opt == "recompute") s.recompute = Recompute::kBlock;
  else if (opt == "bf16") s.bf16 = true;
  else if (opt.rfind("buckets=", 0) == 0) {
    FP_ASSIGN_OR_RETURN(s.head_buckets, parse_degree(opt.substr(8), spec));
  } else {
    return invalid_argument(
        "layout '{}': unknown option '{}' (ring, seqpar, nooverlap, keepw, keepkv, buckets=N, recompute, bf16)", spec,
        opt);
  }
  return Status();
}

}  // namespace

Result<LayoutSpec> parse_layout_spec(const std::string& text) {
  const std::vector<std::string> parts = split(text, ':');
  if (parts.empty() || parts[0].empty()) return invalid_argument("layout '{}': no axis (e.g. tsp=2, tp=2+sp=2)", text);
  LayoutSpec s;
  bool seen_tp = false, seen_sp = false, seen_tsp = false;
  for (const std::string& axis : split(parts[0], '+')) {
    const size_t eq = axis.find('=');
    if (eq == std::string::npos) return invalid_argument("layout '{}': axis '{}' is not name=degree", text, axis);
    const std::string name = axis.substr(0, eq);
    FP_ASSIGN_OR_RETURN(const int degree, parse_degree(axis.substr(eq + 1), text));
    if (name == "dp") s.dp = degree;
    else if (name == "tp") s.tp = degree, seen_tp = true;
    else if (name == "sp") s.sp = degree, seen_sp = true;
    else if (name == "tsp") s.tsp = degree, seen_tsp = true;
    else return invalid_argument("layout '{}': unknown axis '{}' (dp, tp, sp, tsp)", text, name);
  }
  if (!seen_tp && !seen_sp && !seen_tsp) return invalid_argument("layout '{}': needs a model axis (tsp, tp or sp)", text);
  if (seen_tsp && (seen_tp || seen_sp)) return invalid_argument("layout '{}': tsp does not combine with tp or sp", text);
  s.strategy = seen_tsp ? PlanStrategy::kTsp
               : seen_tp && seen_sp ? PlanStrategy::kTpSp
               : seen_tp ? PlanStrategy::kTp
                         : PlanStrategy::kSp;
  for (size_t i = 1; i < parts.size(); ++i) FP_RETURN_IF_ERROR(apply_option(parts[i], text, s));
  return s;
}

Result<std::vector<LayoutSpec>> parse_layout_list(const std::string& text) {
  std::vector<LayoutSpec> out;
  for (const std::string& item : split(text, ',')) {
    if (item.empty()) continue;
    FP_ASSIGN_OR_RETURN(LayoutSpec s, parse_layout_spec(item));
    out.push_back(s);
  }
  if (out.empty()) return invalid_argument("--layouts '{}' names no layout", text);
  return out;
}

int weight_degree(const LayoutSpec& l) {
  switch (l.strategy) {
    case PlanStrategy::kTsp: return l.tsp;
    case PlanStrategy::kTp:
    case PlanStrategy::kTpSp: return l.tp;
    case PlanStrategy::kSp: return 1;
  }
  return 1;
}

int token_degree(const LayoutSpec& l) {
  switch (l.strategy) {
    case PlanStrategy::kTsp: return l.tsp;
    case PlanStrategy::kSp:
    case PlanStrategy::kTpSp: return l.sp;
    case PlanStrategy::kTp: return 1;
  }
  return 1;
}

Status check_layout_sizes(const LlamaConfig& c, const LayoutSpec& l, int64_t batch, int64_t seq) {
  FP_RETURN_IF_ERROR(c.validate());
  if (batch <= 0 || seq <= 0) return invalid_argument("batch ({}) and sequence ({}) must be positive", batch, seq);
  if (batch % l.dp != 0)
    return invalid_argument("{}: the batch ({}) must be divisible by the data-parallel degree ({})", l.name(), batch, l.dp);
  const int W = weight_degree(l), Q = token_degree(l);
  const char* waxis = l.strategy == PlanStrategy::kTsp ? "TSP" : "tensor-parallel";
  const std::pair<const char*, int64_t> sharded[] = {{"num_attention_heads", c.num_attention_heads},
                                                     {"num_key_value_heads", c.num_key_value_heads},
                                                     {"intermediate_size", c.intermediate_size},
                                                     {"vocab_size", c.vocab_size}};
  for (const auto& [name, value] : sharded)
    if (value % W != 0)
      return invalid_argument("{}: {} ({}) must be divisible by the {} degree ({})", l.name(), name, value, waxis, W);
  if (Q > 1 && seq % (2 * Q) != 0)
    return invalid_argument("{}: the sequence ({}) must be divisible by 2 x the sequence degree ({}) for the zigzag split",
                            l.name(), seq, 2 * Q);
  if (l.sequence_parallel && seq % l.tp != 0)
    return invalid_argument("{}: the sequence ({}) must be divisible by the tensor-parallel degree ({}) with seqpar",
                            l.name(), seq, l.tp);
  if (l.strategy == PlanStrategy::kTsp && (c.num_key_value_heads / l.tsp) % l.head_buckets != 0)
    return invalid_argument("{}: head buckets ({}) must divide the KV heads per TSP rank ({} = {} / {})", l.name(),
                            l.head_buckets, c.num_key_value_heads / l.tsp, c.num_key_value_heads, l.tsp);
  return Status();
}

int64_t local_parameter_elements(const LlamaConfig& c, const LayoutSpec& l) {
  const int64_t W = weight_degree(l), h = c.hidden_size, L = c.num_hidden_layers;
  const int64_t layer = (2 * h * h + 2 * h * c.kv_dim()) / W + 3 * h * c.intermediate_size / W + 2 * h;
  return L * layer + h + (c.tie_word_embeddings ? 1 : 2) * (c.vocab_size / W) * h;
}

std::string LayoutSpec::mesh() const {
  std::string m;
  auto add = [&](const char* name, int degree, bool present) {
    if (!present) return;
    if (!m.empty()) m += ',';
    m += fmt::format("{}={}", name, degree);
  };
  add("dp", dp, dp > 1);
  add("tp", tp, strategy == PlanStrategy::kTp || strategy == PlanStrategy::kTpSp);
  add("sp", sp, strategy == PlanStrategy::kSp || strategy == PlanStrategy::kTpSp);
  add("tsp", tsp, strategy == PlanStrategy::kTsp);
  return m;
}

std::string LayoutSpec::name() const {
  std::string n = mesh();
  for (char& c : n)
    if (c == ',') c = '+';
  if (ring) n += ":ring";
  if (sequence_parallel) n += ":seqpar";
  if (!overlap) n += ":nooverlap";
  if (keep_weights) n += ":keepw";
  if (keep_kv) n += ":keepkv";
  if (head_buckets > 1) n += fmt::format(":buckets={}", head_buckets);
  if (recompute == Recompute::kBlock) n += ":recompute";
  if (bf16) n += ":bf16";
  return n;
}

}  // namespace foldpar
