// validate_layout: the one place that decides whether a layout can run a model at (B, S).
// The plan calls it for every candidate and every strategy before it allocates, so the
// plan's verdict and the strategy's are the same by construction (tests/unit/layout_test.cc
// holds them together over a grid).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>

#include "core/check.h"
#include "layout/layout.h"
#include "model/flop_count.h"

namespace foldpar {
namespace {

Status check_axes(const Layout& l, const std::string& name) {
  const std::pair<const char*, int> axes[] = {{"dp", l.dp}, {"pp", l.pp}, {"tsp", l.tsp},
                                              {"tp", l.tp}, {"sp", l.sp}, {"ep", l.ep}};
  for (const auto& [axis, degree] : axes)
    if (degree < 1) return invalid_argument("{}: the degree of {} ({}) must be positive", name, axis, degree);
  if (l.strategy == Strategy::kTsp && (l.tp > 1 || l.sp > 1))
    return invalid_argument("{}: tsp does not combine with tp or sp", name);
  if (l.strategy == Strategy::kMegatron && l.tsp > 1)
    return invalid_argument("{}: tsp does not combine with tp or sp", name);
  return Status();
}

// Knobs that only one strategy reads: set on the other, they would be silently ignored. (A
// Megatron knob on an axis of degree 1 is accepted: that axis issues no collective, so the
// knob changes nothing, as tp=2,sp=1 is tp=2.)
Status check_knobs(const Layout& l, const std::string& name) {
  const bool tsp = l.strategy == Strategy::kTsp;
  if (!tsp && (l.keep_weights || l.keep_kv || l.head_buckets != 1))
    return invalid_argument("{}: keepw, keepkv and buckets are TSP backward policies (layout tsp=N)", name);
  if (l.head_buckets < 1) return invalid_argument("{}: head buckets ({}) must be positive", name, l.head_buckets);
  if (tsp && l.kv_exchange == Layout::KvExchange::kRing)
    return invalid_argument("{}: the ring K/V exchange is the sp axis's (TSP all-gathers K/V)", name);
  if (tsp && l.sequence_parallel)
    return invalid_argument("{}: seqpar (Megatron sequence parallelism) is the tp axis's (TSP shards the sequence "
                            "already)",
                            name);
  if (l.dtype != DType::kF32 && l.dtype != DType::kBF16)
    return invalid_argument("{}: weights and activations are stored in f32 or bf16, not {}", name,
                            dtype_name(l.dtype));
  return Status();
}

// KV heads: n_kv divisible by the weight degree W, or fewer than W with W divisible by n_kv
// (each rank then holds a replica of the one KV head its query heads read; docs/tsp.md
// section 3). Replicas are built for tsp=D (dense and MoE models) and tp=T (with or without
// sp), under pp and dp, in f32 and bf16, with TSP head buckets (the buckets of a rank share
// its one KV head, gathered once per group).
Status check_kv_heads(const LlamaConfig& c, const Layout& l, const std::string& name) {
  const int W = l.weight_degree();
  const int64_t n_kv = c.num_key_value_heads;
  const char* waxis = l.strategy == Strategy::kTsp ? "TSP" : "tp";
  if (n_kv % W == 0) return Status();
  if (n_kv <= 0 || n_kv > W || W % n_kv != 0)
    return invalid_argument("{}: num_key_value_heads ({}) must be divisible by the {} degree ({}), or divide it (KV "
                            "replicas)",
                            name, n_kv, waxis, W);
  return Status();
}

Status check_sizes(const LlamaConfig& c, const Layout& l, int64_t batch, int64_t seq, const std::string& name) {
  if (batch < 0 || seq < 0) return invalid_argument("{}: batch ({}) and sequence ({}) must be positive", name, batch, seq);
  if (batch > 0 && batch % l.dp != 0)
    return invalid_argument("{}: the batch ({}) must be divisible by the data-parallel degree ({})", name, batch, l.dp);
  const int W = l.weight_degree(), Q = l.token_degree();
  const char* waxis = l.strategy == Strategy::kTsp ? "TSP" : "tp";
  const std::pair<const char*, int64_t> sharded[] = {{"num_attention_heads", c.num_attention_heads},
                                                     {"intermediate_size", c.intermediate_size},
                                                     {"vocab_size", c.vocab_size}};
  for (const auto& [field, value] : sharded)
    if (value % W != 0)
      return invalid_argument("{}: {} ({}) must be divisible by the {} degree ({})", name, field, value, waxis, W);
  FP_RETURN_IF_ERROR(check_kv_heads(c, l, name));
  if (seq == 0) return Status();  // a decoder: the prefill pads the prompts to what divides
  if (Q > 1 && l.split == SeqSplit::kZigzag && seq % (2 * Q) != 0)
    return invalid_argument("{}: the sequence length ({}) must be divisible by 2 x the sequence degree (2 x {} = {}) for the "
                            "zigzag split",
                            name, seq, Q, 2 * Q);
  if (Q > 1 && l.split == SeqSplit::kContiguous && seq % Q != 0)
    return invalid_argument("{}: the sequence length ({}) must be divisible by the sequence degree ({})", name, seq, Q);
  if (l.sequence_parallel && (seq / Q) % l.tp != 0) {
    if (Q > 1)
      return invalid_argument("{}: the sequence length ({}) must be divisible by the sp degree x the tp degree ({} x {} = "
                              "{}) with sequence parallelism (the local sequence {} by {})",
                              name, seq, Q, l.tp, Q * l.tp, seq / Q, l.tp);
    return invalid_argument("{}: the sequence length ({}) must be divisible by the tp degree ({}) with sequence "
                            "parallelism",
                            name, seq, l.tp);
  }
  if (l.strategy == Strategy::kTsp && c.num_key_value_heads >= l.tsp &&
      (c.num_key_value_heads / l.tsp) % l.head_buckets != 0)
    return invalid_argument("{}: head buckets ({}) must divide the KV heads per TSP rank ({} = {} / {})", name,
                            l.head_buckets, c.num_key_value_heads / l.tsp, c.num_key_value_heads, l.tsp);
  // KV replicas: the buckets split the rank's query heads and share its one KV head.
  if (l.strategy == Strategy::kTsp && c.num_key_value_heads < l.tsp &&
      (c.num_attention_heads / l.tsp) % l.head_buckets != 0)
    return invalid_argument("{}: head buckets ({}) must divide the query heads per TSP rank ({} = {} / {}) with KV "
                            "replicas",
                            name, l.head_buckets, c.num_attention_heads / l.tsp, c.num_attention_heads, l.tsp);
  return Status();
}

// pp: at least one decoder layer per stage, and a --stage-layers list of p positive counts
// that sums to L.
Status check_stages(const LlamaConfig& c, const Layout& l, const std::string& name) {
  const int64_t L = c.num_hidden_layers;
  if (l.chunks > 1) {
    if (!l.stage_layers.empty())
      return invalid_argument("{}: --stage-layers sets contiguous stages, the interleaved schedule (interleaved:{}) cuts "
                              "the layers into chunks itself; drop one",
                              name, l.chunks);
    if (L < static_cast<int64_t>(l.pp) * l.chunks)
      return invalid_argument("{}: {} layers cannot fill {} pipeline stages x {} chunks = {} chunks (at least one layer "
                              "per chunk)",
                              name, L, l.pp, l.chunks, l.pp * l.chunks);
    return Status();
  }
  if (l.stage_layers.empty()) {
    if (L < l.pp)
      return invalid_argument("{}: {} layers cannot fill {} pipeline stages (at least one layer per stage)", name, L,
                              l.pp);
    return Status();
  }
  const std::string list = fmt::format("{}", fmt::join(l.stage_layers, ","));
  if (static_cast<int>(l.stage_layers.size()) != l.pp)
    return invalid_argument("{}: --stage-layers {} names {} stages, the layout has pp={}", name, list,
                            l.stage_layers.size(), l.pp);
  int64_t sum = 0;
  for (int n : l.stage_layers) {
    if (n < 1) return invalid_argument("{}: --stage-layers {}: every stage needs at least one layer", name, list);
    sum += n;
  }
  if (sum != L)
    return invalid_argument("{}: --stage-layers {} sums to {}, the model has {} layers", name, list, sum, L);
  return Status();
}

// ZB-H1 defers each block's weight-gradient products (model/weight_grad_queue.h) with what
// moves them afterwards (TSP's reduce to the shard's owner and gradient ring, the KV
// replicas' sums and copies): every stage strategy splits; MoE layers do not (their expert
// gradients are summed by the dispatch during the backward), and are refused above.
Status check_zero_bubble(const Layout& l, const std::string& name) {
  if (l.pp == 1)
    return invalid_argument("{}: the zero-bubble schedule (zb) is the pp axis's (a layout with pp=P)", name);
  if (l.chunks > 1)
    return invalid_argument("{}: zb and interleaved:{} are two pipeline schedules; pick one", name, l.chunks);
  return Status();
}

}  // namespace

Status validate_micro_batches(const Layout& l, int64_t m) {
  if (l.pp > 1 && m < l.pp)
    return invalid_argument("{}: {} micro-batches per step cannot fill {} pipeline stages (need m >= p; lower "
                            "--micro-batch or raise --batch)",
                            l.to_string(), m, l.pp);
  if (l.pp > 1 && l.chunks > 1 && m % l.pp != 0)
    return invalid_argument("{}: {} micro-batches per step must be a multiple of the {} pipeline stages under the "
                            "interleaved schedule (interleaved:{})",
                            l.to_string(), m, l.pp, l.chunks);
  return Status();
}

namespace {

// The default cut of L decoder layers into n contiguous pieces (stage_bounds), as layer
// counts, each at least one layer. Cost of a piece: forward matmul FLOPs per token
// (model/flop_count.h: each decoder layer's projections, the LM head's on the last piece; the
// embedding is a lookup, no FLOPs), without attention's S-dependent products, because every
// caller must cut alike and not every caller knows S (a decoder). First the most expensive
// piece as cheap as any cut allows (the pipeline runs at its slowest stage's pace); among
// those cuts the most even one (least sum of squared costs); among those, each piece from the
// first as small as the rest allows (the earlier stages hold more micro-batches in flight
// under 1F1B). Exact dynamic programs over integers, O(n L^2).
std::vector<int64_t> balanced_layers(const LlamaConfig& c, int64_t n) {
  __extension__ typedef __int128 Wide;  // squared sums of FLOPs
  const int64_t L = c.num_hidden_layers, head = head_matmul_flops_per_token(c);
  std::vector<int64_t> prefix{0};  // [L + 1] cost of layers [0, l)
  for (int64_t l = 0; l < L; ++l) prefix.push_back(prefix.back() + layer_matmul_flops_per_token(c, l));
  // Piece g over layers [a, b).
  auto cost = [&](int64_t g, int64_t a, int64_t b) { return prefix[b] - prefix[a] + (g == n - 1 ? head : 0); };
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  // least[g][b]: the cheapest most expensive piece when pieces 0..g-1 cover layers [0, b).
  std::vector<std::vector<int64_t>> least(n + 1, std::vector<int64_t>(L + 1, kNone));
  least[0][0] = 0;
  for (int64_t g = 1; g <= n; ++g)
    for (int64_t b = g; b <= L; ++b)
      for (int64_t a = g - 1; a < b; ++a)
        if (least[g - 1][a] != kNone) least[g][b] = std::min(least[g][b], std::max(least[g - 1][a], cost(g - 1, a, b)));
  const int64_t best = least[n][L];
  // even[g][a]: the least sum of squared costs of pieces g..n-1 over layers [a, L), none above
  // `best`; -1: no such cut.
  std::vector<std::vector<Wide>> even(n + 1, std::vector<Wide>(L + 1, -1));
  even[n][L] = 0;
  auto step = [&](int64_t g, int64_t a, int64_t b) -> Wide {  // piece g = [a, b), then the best rest
    const int64_t k = cost(g, a, b);
    if (k > best || even[g + 1][b] < 0) return -1;
    return static_cast<Wide>(k) * k + even[g + 1][b];
  };
  for (int64_t g = n - 1; g >= 0; --g)
    for (int64_t a = 0; a < L; ++a)
      for (int64_t b = a + 1; b <= L; ++b) {
        const Wide v = step(g, a, b);
        if (v >= 0 && (even[g][a] < 0 || v < even[g][a])) even[g][a] = v;
      }
  FP_CHECK(even[0][0] >= 0, "no cut of {} layers into {} pieces", L, n);
  std::vector<int64_t> layers;
  int64_t a = 0;
  for (int64_t g = 0; g < n; ++g) {
    int64_t b = a + 1;
    while (step(g, a, b) != even[g][a]) ++b;
    layers.push_back(b - a);
    a = b;
  }
  return layers;
}

}  // namespace

std::vector<int64_t> stage_bounds(const LlamaConfig& c, const Layout& l) {
  // Under interleaving the pieces are the p v chunks, balanced the same way.
  const int64_t L = c.num_hidden_layers, p = static_cast<int64_t>(l.pp) * l.chunks;
  FP_CHECK(L >= p, "{} layers for {} pipeline pieces (validate_layout passes first)", L, p);
  std::vector<int64_t> layers;
  if (!l.stage_layers.empty()) layers.assign(l.stage_layers.begin(), l.stage_layers.end());
  else layers = balanced_layers(c, p);
  std::vector<int64_t> bounds{0};
  for (int64_t n : layers) bounds.push_back(bounds.back() + n);
  FP_CHECK(bounds.back() == L, "stage bounds end at {} of {} layers (validate_layout passes first)", bounds.back(), L);
  return bounds;
}

// ep=N: the ranks one expert group spans, N = K G with G the model group (tsp=D: D; the
// Megatron baselines: tp sp) and K consecutive dp replicas (expert parallelism over dp,
// docs/composition.md section 3). ep=1 or ep=G is the model group itself. Built: whole
// experts per rank (E divisible by N), under pp too (each stage's expert groups are K dp
// replicas of that stage's model group); generation takes no dp axis anyway.
Status check_expert_axis(const LlamaConfig& config, const Layout& l, const std::string& name) {
  if (l.ep == 1) return Status();
  const int G = l.expert_group_ranks();
  if (!config.moe.enabled())
    return invalid_argument("layout {}: ep={} spreads the routed experts of a mixture-of-experts model; this model "
                            "has none",
                            name, l.ep);
  if (l.ep % G != 0)
    return invalid_argument("layout {}: ep ({}) must be a multiple of the model group's {} ranks (the expert group is "
                            "ep/{} dp replicas of it)",
                            name, l.ep, G, G);
  const int K = l.ep / G;
  if (l.dp % K != 0)
    return invalid_argument("layout {}: ep/{} ({} = {} / {}) dp replicas per expert group must divide dp ({})", name,
                            G, K, l.ep, G, l.dp);
  if (K > 1 && config.moe.num_experts % l.ep != 0)
    return invalid_argument("layout {}: the {} experts must divide over the ep={} ranks (whole experts per rank when "
                            "the expert group spans dp replicas)",
                            name, config.moe.num_experts, l.ep);
  // On TSP every scheme (a2a, gather, the expert-weight ring) runs over the expert group's
  // communicator (tsp_moe.cc), under pp too: each stage's groups are its own dp replicas
  // (make_layout.cc), which run the stage's schedule in step, so the ring's hops meet.
  return Status();
}

Status validate_layout(const LlamaConfig& config, const Layout& layout, int64_t batch, int64_t seq) {
  FP_RETURN_IF_ERROR(config.validate());
  const std::string name = layout.to_string();
  // The MoE layer runs in the single-rank model (parallel/single_rank_model.h), on a
  // tsp=D axis with E/D whole experts per rank, or D/E ranks per expert each with a slice of
  // its f_e (parallel/tsp/tsp_moe.cc), and on the Megatron layouts tp=T[:seqpar], sp=Q,
  // tp=T,sp=Q with the experts spread the same way over the T*Q ranks of the tp x sp group
  // (parallel/megatron/tp_moe.cc); with or without a dp axis (the routing statistics summed
  // over the expert axis and dp), in f32 or bf16 storage. Under pp on TSP and Megatron stages
  // (1F1B and interleaved), each micro-batch's routing statistics travelling with it across
  // the stage boundaries (parallel/pipeline/pipeline_model.h); not under ZB-H1.
  if (layout.moe_dispatch != Layout::MoeDispatchOption::kAuto && layout.strategy != Strategy::kTsp)
    return invalid_argument("{}: moe=a2a|gather|ring chooses the dispatch of a tsp=N layout", name);
  if (config.moe.enabled()) {
    const MoeConfig& m = config.moe;
    if (layout.pp > 1 && layout.zero_bubble)
      return unimplemented("layout {}: the zero-bubble schedule (zb) does not split a mixture-of-experts layer's "
                           "backward (its expert gradients travel with the dispatch); use 1f1b or interleaved:N",
                           name);
    // The capacity limit counts each sequence's pairs in position order: the ranks holding a
    // sequence exchange their ids for it (TspStep / TpStepBase::drop_over_capacity); the
    // Megatron exchange runs over the expert axis, which with ep > tp x sp spans other dp
    // replicas' sequences too.
    if (m.capacity_factor > 0 && layout.strategy != Strategy::kTsp && layout.ep > layout.tp * layout.sp)
      return unimplemented("layout {}: moe_capacity_factor {} (dropping pairs over an expert's capacity) with ep "
                           "({}) beyond tp x sp ({}) is not supported; use ep=tp*sp or remove the key",
                           name, m.capacity_factor, layout.ep, layout.tp * layout.sp);
    // TSP: the experts over the TSP axis; the Megatron baselines: over the tp x sp group
    // (expert parallelism, parallel/megatron/tp_moe.cc).
    const bool tsp = layout.strategy == Strategy::kTsp;
    const int64_t D = tsp ? layout.tsp : static_cast<int64_t>(layout.tp) * layout.sp, E = m.num_experts;
    const char* axis = tsp ? "TSP ranks" : "tp x sp ranks (the expert axis)";
    // E % D == 0: E/D whole experts per rank; D % E == 0: each expert's f_e split over its D/E ranks.
    if (D > 1 && E % D != 0 && D % E != 0)
      return invalid_argument("layout {}: the {} experts must divide over the {} {}, or the ranks over the "
                              "experts (D/E ranks share an expert)",
                              name, E, D, axis);
    if (D > E && m.moe_intermediate_size % (D / E) != 0)
      return invalid_argument("layout {}: moe_intermediate_size ({}) must be divisible by the {} per expert "
                              "({} = {} ranks / {} experts)",
                              name, m.moe_intermediate_size, axis, D / E, D, E);
    // Plain tp: each tp rank dispatches its block of S/(sp tp) positions of every sequence.
    if (!tsp && layout.tp > 1 && !layout.sequence_parallel && seq > 0 && (seq / layout.sp) % layout.tp != 0)
      return invalid_argument("layout {}: a mixture-of-experts model on tp={} needs the positions per sp rank ({} = {} "
                              "/ {}) divisible by tp (each tp rank dispatches its share)",
                              name, layout.tp, seq / layout.sp, seq, layout.sp);
  }
  FP_RETURN_IF_ERROR(check_axes(layout, name));
  FP_RETURN_IF_ERROR(check_expert_axis(config, layout, name));
  FP_RETURN_IF_ERROR(check_knobs(layout, name));
  if (layout.pp == 1 && !layout.stage_layers.empty())
    return invalid_argument("{}: --stage-layers is the pp axis's (a layout with pp=P)", name);
  if (layout.chunks < 1) return invalid_argument("{}: the chunks per rank ({}) must be positive", name, layout.chunks);
  if (layout.pp == 1 && layout.chunks > 1)
    return invalid_argument("{}: the interleaved schedule (interleaved:{}) is the pp axis's (a layout with pp=P)", name,
                            layout.chunks);
  if (layout.zero_bubble) FP_RETURN_IF_ERROR(check_zero_bubble(layout, name));
  if (layout.pp > 1) FP_RETURN_IF_ERROR(check_stages(config, layout, name));
  return check_sizes(config, layout, batch, seq, name);
}

}  // namespace foldpar
