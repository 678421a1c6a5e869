// Parsing layouts and writing them back in the canonical spelling (layout.h).
#include "layout/layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>

namespace foldpar {
namespace {

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == sep) {
      out.emplace_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return s;
}

Result<int> parse_degree(std::string_view text, std::string_view layout, std::string_view what) {
  int v = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || ptr != end || v < 1)
    return invalid_argument("layout '{}': {} must be a positive integer, got '{}'", layout, what, text);
  return v;
}

Status apply_option(std::string_view opt, std::string_view text, Layout& l) {
  if (opt == "ring") l.kv_exchange = Layout::KvExchange::kRing;
  else if (opt == "seqpar") l.sequence_parallel = true;
  else if (opt == "contiguous") l.split = SeqSplit::kContiguous;
  else if (opt == "nooverlap") l.overlap = false;
  else if (opt == "keepw") l.keep_weights = true;
  else if (opt == "keepkv") l.keep_kv = true;
  else if (opt == "recompute") l.recompute = Recompute::kBlock;
  else if (opt == "bf16") l.dtype = DType::kBF16;
  else if (opt.starts_with("stages=")) {
    l.stage_layers.clear();
    for (const std::string& n : split(opt.substr(7), '/')) {
      FP_ASSIGN_OR_RETURN(int layers, parse_degree(n, text, "the layers of a stage"));
      l.stage_layers.push_back(layers);
    }
  } else if (opt == "zb") {
    l.zero_bubble = true;
  } else if (opt.starts_with("interleaved=")) {
    FP_ASSIGN_OR_RETURN(l.chunks, parse_degree(opt.substr(12), text, "the chunks per rank of interleaved"));
  } else if (opt == "moe=auto") {
    l.moe_dispatch = Layout::MoeDispatchOption::kAuto;
  } else if (opt == "moe=a2a") {
    l.moe_dispatch = Layout::MoeDispatchOption::kAllToAll;
  } else if (opt == "moe=gather") {
    l.moe_dispatch = Layout::MoeDispatchOption::kGather;
  } else if (opt == "moe=ring") {
    l.moe_dispatch = Layout::MoeDispatchOption::kRing;
  } else if (opt.starts_with("buckets=")) {
    FP_ASSIGN_OR_RETURN(l.head_buckets, parse_degree(opt.substr(8), text, "the head buckets"));
  } else {
    return invalid_argument(
        "layout '{}': unknown option '{}' (ring, seqpar, contiguous, nooverlap, keepw, keepkv, buckets=N, recompute, "
        "bf16, stages=A/B/.., interleaved=V, zb, moe=a2a|gather|ring|auto)",
        text, opt);
  }
  return Status();
}

int* axis_field(Layout& l, std::string_view name) {
  if (name == "dp") return &l.dp;
  if (name == "pp") return &l.pp;
  if (name == "tsp") return &l.tsp;
  if (name == "tp") return &l.tp;
  if (name == "sp") return &l.sp;
  if (name == "ep") return &l.ep;
  return nullptr;
}

}  // namespace

Result<Layout> parse_layout(std::string_view text, std::string* note) {
  text = trim(text);
  const std::vector<std::string> parts = split(text, ':');
  if (trim(parts[0]).empty()) return invalid_argument("layout '{}': no axis (e.g. tsp=4, tp=2,sp=2, dp=2,tsp=2)", text);
  const bool old_spelling = parts[0].find('+') != std::string::npos;
  if (old_spelling && parts[0].find(',') != std::string::npos)
    return invalid_argument("layout '{}': axes are joined by ',' (the old '+' cannot be mixed with it)", text);
  Layout l;
  std::vector<std::string> seen;
  for (const std::string& raw : split(parts[0], old_spelling ? '+' : ',')) {
    const std::string_view axis = trim(raw);
    const size_t eq = axis.find('=');
    if (eq == std::string_view::npos) return invalid_argument("layout '{}': axis '{}' is not name=degree", text, axis);
    const std::string name(trim(axis.substr(0, eq)));
    int* field = axis_field(l, name);
    if (field == nullptr) return invalid_argument("layout '{}': unknown axis '{}' (dp, pp, tsp, tp, sp, ep)", text, name);
    for (const std::string& s : seen)
      if (s == name) return invalid_argument("layout '{}': axis '{}' is given twice", text, name);
    seen.push_back(name);
    FP_ASSIGN_OR_RETURN(*field, parse_degree(trim(axis.substr(eq + 1)), text, fmt::format("the degree of {}", name)));
  }
  auto named = [&](std::string_view n) {
    for (const std::string& s : seen)
      if (s == n) return true;
    return false;
  };
  const bool tsp = named("tsp"), megatron = named("tp") || named("sp");
  if (!tsp && !megatron) return invalid_argument("layout '{}': needs a model axis (tsp, tp or sp)", text);
  if (tsp && megatron) return invalid_argument("layout '{}': tsp does not combine with tp or sp", text);
  l.strategy = tsp ? Strategy::kTsp : Strategy::kMegatron;
  for (size_t i = 1; i < parts.size(); ++i) FP_RETURN_IF_ERROR(apply_option(trim(parts[i]), text, l));
  if (old_spelling && note != nullptr)
    *note = fmt::format("layout '{}' is written '{}' (the '+' spelling will go)", text, l.to_string());
  return l;
}

namespace {

// The old list spelling: layouts between commas, each with its axes between '+'.
Result<std::vector<Layout>> parse_old_list(const std::string& item) {
  std::vector<Layout> out;
  for (const std::string& piece : split(item, ',')) {
    if (trim(piece).empty()) continue;
    FP_ASSIGN_OR_RETURN(Layout l, parse_layout(piece, nullptr));
    out.push_back(l);
  }
  return out;
}

}  // namespace

Result<std::vector<Layout>> parse_layout_list(const std::vector<std::string>& items, std::string* note) {
  std::vector<Layout> out;
  bool old_spelling = false;
  for (const std::string& item : items) {
    const bool has_comma = item.find(',') != std::string::npos;
    if (has_comma && item.find('+') != std::string::npos) {
      FP_ASSIGN_OR_RETURN(std::vector<Layout> old, parse_old_list(item));
      out.insert(out.end(), old.begin(), old.end());
      old_spelling = true;
      continue;
    }
    for (const std::string& piece : split(item, ';')) {
      if (trim(piece).empty()) continue;
      std::string piece_note;
      Result<Layout> l = parse_layout(piece, &piece_note);
      if (!l.ok() && has_comma) {
        // "tsp=2,tp=2,sp=2:ring" cannot be one layout; read as the old list, it is three.
        Result<std::vector<Layout>> old = parse_old_list(piece);
        if (!old.ok()) return l.status();
        out.insert(out.end(), old->begin(), old->end());
        old_spelling = true;
        continue;
      }
      FP_RETURN_IF_ERROR(l.status());
      old_spelling = old_spelling || !piece_note.empty();
      out.push_back(*l);
    }
  }
  if (out.empty()) return invalid_argument("the layout list '{}' names no layout", fmt::join(items, " "));
  if (old_spelling && note != nullptr) {
    std::vector<std::string> names;
    for (const Layout& l : out) names.push_back(l.to_string());
    *note = fmt::format("the layout list '{}' is written '{}': layouts between spaces (or ';'), axes joined by ',' "
                        "(the old spelling will go)",
                        fmt::join(items, " "), fmt::join(names, " "));
  }
  return out;
}

namespace {

// The axes as written, outermost first; `expert`: with ep, last (it is no mesh axis: the
// expert groups are cut from dp and the model axes, parallel/make_layout.cc).
std::string axis_list(const Layout& l, bool expert) {
  std::vector<std::string> axes;
  auto add = [&](const char* name, int degree, bool always) {
    if (degree > 1 || always) axes.push_back(fmt::format("{}={}", name, degree));
  };
  add("pp", l.pp, false);  // pp outermost, then dp (docs/composition.md section 1)
  add("dp", l.dp, false);
  if (l.strategy == Strategy::kTsp) {
    add("tsp", l.tsp, true);
  } else {
    add("tp", l.tp, l.sp == 1);
    add("sp", l.sp, false);
  }
  if (expert) add("ep", l.ep, false);
  return fmt::format("{}", fmt::join(axes, ","));
}

}  // namespace

std::string Layout::mesh() const { return axis_list(*this, false); }

std::string Layout::to_string() const {
  std::string n = axis_list(*this, true);
  if (kv_exchange == KvExchange::kRing) n += ":ring";
  if (sequence_parallel) n += ":seqpar";
  if (split == SeqSplit::kContiguous) n += ":contiguous";
  if (!overlap) n += ":nooverlap";
  if (keep_weights) n += ":keepw";
  if (keep_kv) n += ":keepkv";
  if (head_buckets > 1) n += fmt::format(":buckets={}", head_buckets);
  if (recompute == Recompute::kBlock) n += ":recompute";
  if (dtype == DType::kBF16) n += ":bf16";
  if (!stage_layers.empty()) n += fmt::format(":stages={}", fmt::join(stage_layers, "/"));
  if (chunks > 1) n += fmt::format(":interleaved={}", chunks);
  if (zero_bubble) n += ":zb";
  if (moe_dispatch == MoeDispatchOption::kAllToAll) n += ":moe=a2a";
  if (moe_dispatch == MoeDispatchOption::kGather) n += ":moe=gather";
  if (moe_dispatch == MoeDispatchOption::kRing) n += ":moe=ring";
  return n;
}

Result<PipelineSchedule> parse_schedule(std::string_view text) {
  if (text == "1f1b") return PipelineSchedule{};
  if (text == "zb") return PipelineSchedule{1, true};
  if (text.starts_with("interleaved:")) {
    int v = 0;
    const std::string_view n = text.substr(12);
    const auto [ptr, ec] = std::from_chars(n.data(), n.data() + n.size(), v);
    if (!n.empty() && ec == std::errc() && ptr == n.data() + n.size() && v >= 1) return PipelineSchedule{v, false};
  }
  return invalid_argument(
      "--schedule {}: the pipeline schedules are 1f1b, interleaved:V (V >= 1 chunks per rank) and zb (ZB-H1)", text);
}

std::string schedule_name(const Layout& l) {
  if (l.zero_bubble) return "zb";
  return l.chunks > 1 ? fmt::format("interleaved:{}", l.chunks) : "1f1b";
}

Layout tsp_layout(int degree) {
  Layout l;
  l.tsp = degree;
  return l;
}

int64_t local_parameter_elements(const LlamaConfig& c, const Layout& l, int stage) {
  const int64_t W = l.weight_degree(), h = c.hidden_size;
  // K/V rows per rank: kv_dim / W, or with KV replicas (n_kv < W) one whole KV head.
  const int64_t kv = c.num_key_value_heads < W ? 2 * h * c.head_dim() : 2 * h * c.kv_dim() / W;
  const int64_t layer = 2 * h * c.q_dim() / W + kv + 3 * h * c.intermediate_size / W + 2 * h;
  const int64_t table = (c.vocab_size / W) * h;  // the embedding's or the LM head's shard
  if (l.pp == 1) return c.num_hidden_layers * layer + h + (c.tie_word_embeddings ? 1 : 2) * table;
  const std::vector<int64_t> bounds = stage_bounds(c, l);
  int64_t n = 0;
  for (size_t g = static_cast<size_t>(stage); g + 1 < bounds.size(); g += static_cast<size_t>(l.pp))
    n += (bounds[g + 1] - bounds[g]) * layer;  // the stage's chunks s, s + p, ...
  if (stage == 0) n += table;
  if (stage == l.pp - 1) n += h + table;
  return n;
}

Layout::MoeDispatchOption moe_dispatch_by_bytes(const MoeConfig& m, int64_t tokens_per_rank, int degree) {
  // G = D/E ranks per expert when D > E: the all-to-all sends each routed row to G ranks, so
  // A's bytes grow by G (B never beats it then: D < k G = k D / E needs k > E).
  const int64_t G = degree > m.num_experts ? degree / m.num_experts : 1;
  const double ring_break_even = 2.25 * static_cast<double>(m.num_experts * m.moe_intermediate_size) /
                                 static_cast<double>(m.num_experts_per_tok * G);
  if (static_cast<double>(tokens_per_rank) > ring_break_even) return Layout::MoeDispatchOption::kRing;
  return degree < m.num_experts_per_tok * G ? Layout::MoeDispatchOption::kGather : Layout::MoeDispatchOption::kAllToAll;
}

}  // namespace foldpar
