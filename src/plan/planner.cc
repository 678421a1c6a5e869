// The planner: candidates, the time estimate, the choice, and the two report formats.
#include "plan/planner.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <optional>
#include <nlohmann/json.hpp>

#include "layout/layout.h"
#include "parallel/sharded_weights.h"
#include "plan/dry_run.h"

namespace foldpar {
namespace {

// Whether an axis's rank group fits inside one node. Mesh order: the first axis written is
// the outermost, so an axis's ranks lie `stride` apart with stride the product of the
// degrees written after it.
bool axis_inside_node(const Layout& l, const std::string& axis, int devices_per_node) {
  std::vector<std::pair<std::string, int>> order;
  if (l.pp > 1) order.emplace_back("pp", l.pp);
  if (l.dp > 1) order.emplace_back("dp", l.dp);
  if (plan_strategy(l) == PlanStrategy::kTsp) order.emplace_back("tsp", l.tsp);
  if (plan_strategy(l) == PlanStrategy::kTp || plan_strategy(l) == PlanStrategy::kTpSp) order.emplace_back("tp", l.tp);
  if (plan_strategy(l) == PlanStrategy::kSp || plan_strategy(l) == PlanStrategy::kTpSp) order.emplace_back("sp", l.sp);
  int64_t stride = 1;
  for (size_t i = order.size(); i-- > 0;) {
    if (order[i].first == axis) return stride * order[i].second <= devices_per_node;
    stride *= order[i].second;
  }
  return true;
}

// Memory columns in GB, or in MB when every layout's total is under 1 GB.
struct Unit {
  double scale;
  const char* name;
};
Unit unit_for(const PlanReport& rep) {
  int64_t largest = 0;
  for (const LayoutPlan& p : rep.layouts) largest = std::max(largest, p.memory.total());
  return largest >= 1000000000 ? Unit{1e9, "GB"} : Unit{1e6, "MB"};
}
std::string in_unit(int64_t bytes, const Unit& u) { return fmt::format("{:.2f}", static_cast<double>(bytes) / u.scale); }

std::string bytes_text(double b) {
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.2f} MB", b / 1e6);
  return fmt::format("{:.1f} kB", b / 1e3);
}

PlanOp plan_op(CommOpKind k) {
  switch (k) {
    case CommOpKind::kBroadcast: return PlanOp::kBroadcast;
    case CommOpKind::kReduce: return PlanOp::kReduce;
    case CommOpKind::kAllReduce: return PlanOp::kAllReduce;
    case CommOpKind::kAllGather:
    case CommOpKind::kAllGatherV: return PlanOp::kAllGather;
    case CommOpKind::kReduceScatter:
    case CommOpKind::kReduceScatterV: return PlanOp::kReduceScatter;
    case CommOpKind::kAllToAll: return PlanOp::kAllToAll;
    default: return PlanOp::kSendRecv;  // send, recv, send_recv (barriers move nothing)
  }
}

DryRunMode dry_mode(PlanMode m) {
  switch (m) {
    case PlanMode::kTrain: return DryRunMode::kForwardBackward;
    case PlanMode::kForward: return DryRunMode::kForward;
    case PlanMode::kPrefill: return DryRunMode::kPrefill;
    case PlanMode::kDecode: return DryRunMode::kDecode;
  }
  return DryRunMode::kForwardBackward;
}

// How many model ranks per stage the plan simulates all of, together: up to this many every
// collective and ring step waits for its last member (the peers' lag); beyond it, to keep
// plans of large meshes fast, the distinct ranks alone (rank_groups).
constexpr int kCoupledModelRanks = 4;
// A MoE model's ranks do different expert work (the routing), so without pp the plan couples
// all of them up to this many; beyond it (a search over hundreds of devices offers sp or tsp
// of 128 and more, each rank's trace held at once) the first and last as for a dense model:
// rank 0 owns expert 0, the busiest under planned_moe_routing.
constexpr int kCoupledMoeRanks = 16;

struct GroupRank {
  int rank = 0, stage = 0;  // world rank, its pipeline stage
};

// The world ranks whose dry runs give a layout's figures, in groups simulated together. Mesh
// order pp, dp, then the model axes: stage s of replica 0 starts at world rank s * dp * inner.
// Up to kCoupledModelRanks model ranks per stage, and on a MoE model without pp (its ranks'
// expert work differs with the routing) up to kCoupledMoeRanks: every model rank of replica
// 0, of every stage, in one group. Otherwise the first and the last model rank of a stage (zigzag ends, the last
// vocabulary shard), one group each, holding that rank of every pipeline stage.
std::vector<std::vector<GroupRank>> rank_groups(const Layout& l, bool moe) {
  const int inner = l.model_ranks() / l.pp;
  auto rank_of = [&](int s, int i) { return GroupRank{s * l.dp * inner + i, s}; };
  if (inner <= kCoupledModelRanks || (moe && l.pp == 1 && inner <= kCoupledMoeRanks)) {
    std::vector<GroupRank> all;
    for (int s = 0; s < l.pp; ++s)
      for (int i = 0; i < inner; ++i) all.push_back(rank_of(s, i));
    return {all};
  }
  std::vector<int> index{0};
  if (inner > 1) index.push_back(inner - 1);
  std::vector<std::vector<GroupRank>> groups;
  for (int i : index) {
    std::vector<GroupRank> g;
    for (int s = 0; s < l.pp; ++s) g.push_back(rank_of(s, i));
    groups.push_back(g);
  }
  return groups;
}

// One rank's dry run and its timeline trace, with the trainer's dp gradient all_reduce (one
// per step, after the backward; traffic_model's dp term) at its end, blocking.
struct RankRun {
  int rank = 0, stage = 0;
  DryRunResult dry;
  RankTrace trace;
  StepTraffic traffic;
};

Result<RankRun> run_rank(const PlanRequest& r, const Layout& l, int rank, int stage, int64_t micro_batch) {
  RankRun run;
  run.rank = rank;
  run.stage = stage;
  DryRunOptions o;
  o.config = r.config;
  o.layout = l;
  o.rank = rank;
  o.batch = r.batch;
  o.seq = r.seq;
  o.mode = dry_mode(r.mode);
  o.max_new_tokens = std::max<int64_t>(1, r.max_new_tokens);
  o.micro_batch = micro_batch;
  o.moe_imbalance = r.moe_imbalance;
  // Unless the request says: a machine that states a bf16 rate (the accelerators' files)
  // runs bf16 layouts on a backend that stores bf16 itself, as the CUDA backend does; one
  // without (a CPU's calibrated file) through the bf16 storage decorator, as train does
  // on the CPU.
  const bool bf16_rate = l.dtype == DType::kBF16 && r.hardware.peak_tflops_bf16 > 0;
  o.bf16_native = l.dtype == DType::kBF16 && r.bf16_native.value_or(bf16_rate);
  o.matmul_takes_bf16 = l.dtype == DType::kBF16 && r.matmul_takes_bf16.value_or(bf16_rate);
  FP_ASSIGN_OR_RETURN(run.dry, dry_run(o));
  FP_ASSIGN_OR_RETURN(run.trace, step_timeline_trace(run.dry, rank, r.hardware.devices_per_node));
  std::optional<AxisTraffic> dp_axis, edp_axis;
  if (r.mode == PlanMode::kTrain && l.dp > 1) {
    // The trainer's gradient sums after the step: over dp and, with experts over dp replicas
    // (ep = K G), the routed experts' over the dp/K replicas holding them (stride K replicas).
    const int inner = l.model_ranks() / l.pp;  // the dp axis's stride
    const int K = r.config.moe.enabled() ? l.expert_replicas() : 1;
    dp_axis = dp_gradient_traffic(r.config, l, stage);
    if (K > 1 && l.dp > K) edp_axis = expert_dp_gradient_traffic(r.config, l, stage);
    for (const auto& [axis, stride] : {std::pair{&dp_axis, inner}, std::pair{&edp_axis, inner * K}}) {
      if (!*axis) continue;
      const OpBytes& ar = (*axis)->op(PlanOp::kAllReduce);
      Result<LinkClass> link = link_class({rank, rank + stride * ((*axis)->degree - 1)}, r.hardware.devices_per_node);
      FP_RETURN_IF_ERROR(link.status());
      run.trace.events.emplace_back(CommStart{.request = (1 << 30) + (axis == &edp_axis ? 1 : 0),
                                              .kind = CommKind::kAllReduce, .communicator = (*axis)->axis,
                                              .comm_size = (*axis)->degree, .link = *link,
                                              .bytes_sent = ar.bytes_sent, .bytes_received = ar.bytes_received,
                                              .blocking = true, .members = {}});
    }
  }
  for (const auto& [name, stats] : run.dry.comm) {
    AxisTraffic a{name, 1, {}};
    for (const CommTrace::Member& mem : run.dry.comm_trace.comms)
      if (mem.name == name) a.degree = mem.size;
    for (int k = 0; k < kNumCommOpKinds; ++k) {
      const OpCounters& c = stats.op(static_cast<CommOpKind>(k));
      if (c.calls == 0 || static_cast<CommOpKind>(k) == CommOpKind::kBarrier) continue;
      OpBytes& o2 = a.ops[static_cast<int>(plan_op(static_cast<CommOpKind>(k)))];
      o2.calls += c.calls;
      o2.bytes_sent += c.bytes_sent;
      o2.bytes_received += c.bytes_received;
    }
    if (name == "dp" || name == "edp") continue;  // the model step moves nothing over dp
    run.traffic.axes.push_back(a);
  }
  if (dp_axis) run.traffic.axes.push_back(*dp_axis);
  if (edp_axis) run.traffic.axes.push_back(*edp_axis);
  return run;
}

// The figures of one layout from the dry runs of its distinct ranks (rank_groups), the worst
// of each figure; a group's ranks are simulated together (simulate_coupled: a pipeline's
// stages, a MoE model's ranks), so a rank waits for its neighbours, and the memory is the
// heaviest rank's.
Status plan_by_dry_run(const PlanRequest& r, LayoutPlan& p, int64_t micro_batch) {
  const Layout& l = p.layout;
  const int64_t rows = r.batch / l.dp;
  p.micro_batch = r.mode != PlanMode::kTrain ? 0 : micro_batch > 0 ? micro_batch : rows;
  p.micro_batches = p.micro_batch > 0 && rows % p.micro_batch == 0 ? rows / p.micro_batch : 1;
  bool first = true;
  double busiest = 0, busiest_other_waits = 0;  // the most compute of a rank so far, its non-pipeline waits
  for (const std::vector<GroupRank>& group : rank_groups(l, r.config.moe.enabled())) {
    std::vector<RankRun> runs;
    std::vector<RankTrace> traces;
    for (const GroupRank& g : group) {
      FP_ASSIGN_OR_RETURN(RankRun run, run_rank(r, l, g.rank, g.stage, p.micro_batch));
      traces.push_back(run.trace);
      runs.push_back(std::move(run));
    }
    std::vector<RankTimeline> timelines;
    FP_ASSIGN_OR_RETURN(timelines, group.size() > 1 ? simulate_coupled(traces, r.hardware)
                                                    : simulate_ranks(traces, r.hardware));
    for (size_t i = 0; i < runs.size(); ++i) {
      const RankRun& run = runs[i];
      RankTimeline& tl = timelines[i];
      MemoryEstimate m;
      m.at_peak = run.dry.step.at_peak;
      m.peak = run.dry.step.peak_total;
      m.phase = l.pp > 1 ? fmt::format("rank {} (stage {})", run.rank, run.stage) : fmt::format("rank {}", run.rank);
      if (r.mode == PlanMode::kTrain) {
        // MoE: the parameters the dry run built (the router, E/D experts, the shared
        // expert), which local_parameter_elements' dense formula does not describe.
        const int64_t P_local =
            r.config.moe.enabled()
                ? run.dry.after_build.current[static_cast<int>(MemCategory::kParameters)] / l.storage_bytes()
                : local_parameter_elements(r.config, l, run.stage);
        m.optimizer = 8 * P_local + (l.storage_bytes() == 4 ? 0 : 4 * P_local);
      }
      if (first || m.total() > p.memory.total()) {
        p.memory = m;
        p.heaviest_stage = run.stage;
      }
      if (first || run.traffic.total().bytes_sent > p.traffic.total().bytes_sent) p.traffic = run.traffic;
      if (first || tl.step_s > p.time.step_s) {
        p.time.compute_s = tl.compute_s;
        p.time.exposed_comm_s = tl.exposed_comm_s;
        p.time.step_s = tl.step_s;
        p.time.intra_node_s = p.time.inter_node_s = 0;
        for (const TimelineOp& op : tl.ops)
          if (op.kind == TimelineOp::Kind::kTransfer)
            (op.stream == Stream::kCommInter ? p.time.inter_node_s : p.time.intra_node_s) += op.end - op.start;
      }
      // The busiest rank: the most compute, and what it waits for besides its neighbour stages.
      if (first || tl.compute_s > busiest) {
        busiest = tl.compute_s;
        busiest_other_waits = 0;
        for (const KindTotals& k : tl.by_kind)
          if (k.transfer && !(k.communicator == "pp" && (k.kind == "send" || k.kind == "recv")))
            busiest_other_waits += k.exposed_s;
      }
      p.timelines.push_back(std::move(tl));
      first = false;
    }
  }
  // The bubble: how long the busiest stage idles in the step for want of its neighbours (its
  // waits on them, and the end of the step it reaches before the slowest stage does).
  if (l.pp > 1) p.bubble_s = std::max(0.0, p.time.step_s - busiest - busiest_other_waits);
  const double tokens = r.mode == PlanMode::kDecode ? static_cast<double>(r.batch)
                                                    : static_cast<double>(r.batch) * static_cast<double>(r.seq);
  p.time.tokens_per_s = p.time.step_s > 0 ? tokens / p.time.step_s : 0;
  return Status();
}

// Of two plans, whether q beats best: one that fits beats one that does not; among those
// that fit the most tokens/s; among those that do not the least memory.
bool better_plan(const LayoutPlan& q, const std::optional<LayoutPlan>& best, int64_t capacity) {
  if (!best) return true;
  const bool fits = q.memory.total() <= capacity, best_fits = best->memory.total() <= capacity;
  if (fits != best_fits) return fits;
  return fits ? q.time.tokens_per_s > best->time.tokens_per_s : q.memory.total() < best->memory.total();
}

// A pipeline without a micro-batch size: each size that divides the rows per dp rank and
// gives m >= p micro-batches, largest m first; the fastest that fits, else the smallest.
// With a micro-batch size: that one alone.
Status plan_micro_batches(const PlanRequest& r, LayoutPlan& p) {
  if (r.micro_batch > 0) return plan_by_dry_run(r, p, r.micro_batch);
  const int64_t rows = r.batch / std::max(1, p.layout.dp);
  std::optional<LayoutPlan> best;
  std::vector<std::pair<int64_t, double>> tried;
  const int64_t capacity = r.hardware.memory_bytes();
  for (int64_t micro = 1; micro <= rows; ++micro) {
    if (rows % micro != 0 || !validate_micro_batches(p.layout, rows / micro).ok()) continue;
    LayoutPlan q;
    q.layout = p.layout;
    FP_RETURN_IF_ERROR(plan_by_dry_run(r, q, micro));
    tried.emplace_back(micro, q.time.tokens_per_s);
    if (better_plan(q, best, capacity)) best = std::move(q);
  }
  if (!best)  // the message of the trainer's refusal, with the numbers
    return validate_micro_batches(p.layout, rows);
  p = std::move(*best);
  p.micro_batch_tried = std::move(tried);
  return Status();
}

// A pipeline whose schedule the plan chooses: 1F1B, interleaved with v = 2 and ZB-H1, each
// where validate_layout accepts it (L >= 2p and no --stage-layers for interleaving), each
// over its micro-batch sizes (plan_micro_batches); the best of them (better_plan). Says
// why: the tokens/s and bubbles of those that fit, the memory of those that do not.
Status plan_pipeline(const PlanRequest& r, LayoutPlan& p) {
  const bool named = p.layout.chunks > 1 || p.layout.zero_bubble;
  if (!r.choose_schedule || named) return plan_micro_batches(r, p);
  std::vector<Layout> schedules{p.layout};
  Layout interleaved = p.layout, zb = p.layout;
  interleaved.chunks = 2;
  zb.zero_bubble = true;
  std::vector<std::string> refused;
  for (const Layout& l : {interleaved, zb}) {
    const Status ok = validate_layout(r.config, l, r.batch, r.seq);
    if (ok.ok()) schedules.push_back(l);
    else refused.push_back(fmt::format("{} ({})", schedule_name(l), ok.message()));
  }
  const int64_t capacity = r.hardware.memory_bytes();
  std::optional<LayoutPlan> best;
  std::vector<LayoutPlan::ScheduleTry> tried;
  Status first_error;
  for (const Layout& l : schedules) {
    LayoutPlan q;
    q.layout = l;
    const Status s = plan_micro_batches(r, q);
    if (!s.ok()) {  // no micro-batch count this schedule takes (interleaving: m % p)
      if (first_error.ok()) first_error = s;
      refused.push_back(fmt::format("{} ({})", schedule_name(l), s.message()));
      continue;
    }
    tried.push_back({schedule_name(l), q.micro_batch, q.micro_batches, q.time.tokens_per_s, q.bubble_s, q.time.step_s,
                     q.memory.total(), q.memory.total() <= capacity});
    if (better_plan(q, best, capacity)) best = std::move(q);
  }
  if (!best) return first_error;
  p = std::move(*best);
  const std::string chosen = schedule_name(p.layout);
  std::vector<std::string> faster, over;
  for (const LayoutPlan::ScheduleTry& t : tried) {
    if (t.schedule == chosen) continue;
    if (t.fits) {
      faster.push_back(fmt::format("{} {:.4g} tokens/s at m={} (bubble {:.3g} s)", t.schedule, t.tokens_per_s,
                                   t.micro_batches, t.bubble_s));
    } else {
      over.push_back(fmt::format("{} needs {} on its heaviest stage, over the device's {}", t.schedule,
                                 bytes_text(static_cast<double>(t.memory)), bytes_text(static_cast<double>(capacity))));
    }
  }
  std::string why = fmt::format("{} at m={}: {:.4g} tokens/s, bubble {:.3g} s, {} on its heaviest stage", chosen,
                                p.micro_batches, p.time.tokens_per_s, p.bubble_s,
                                bytes_text(static_cast<double>(p.memory.total())));
  if (!faster.empty()) why += fmt::format("; beside {}", fmt::join(faster, ", "));
  if (!over.empty()) why += fmt::format("; ruled out by memory: {}", fmt::join(over, ", "));
  if (!refused.empty()) why += fmt::format("; not planned: {}", fmt::join(refused, "; "));
  p.schedule_tried = std::move(tried);
  p.schedule_reason = std::move(why);
  return Status();
}

const char* dispatch_name(Layout::MoeDispatchOption d) {
  switch (d) {
    case Layout::MoeDispatchOption::kAllToAll: return "a2a";
    case Layout::MoeDispatchOption::kGather: return "gather";
    case Layout::MoeDispatchOption::kRing: return "ring";
    case Layout::MoeDispatchOption::kAuto: break;
  }
  return "auto";
}

// The expert memory and the assumption's figures of a MoE model on tsp=D or tp x sp
// (MoePlan); under pp, of pipeline stage `stage` (the heaviest).
MoePlan moe_plan_base(const PlanRequest& r, const Layout& l, int64_t micro_batch, int stage = -1) {
  const LlamaConfig& c = r.config;
  const MoeConfig& m = c.moe;
  MoePlan mp;
  mp.experts = m.num_experts;
  // The expert axis: tsp, or the Megatron layouts' tp x sp group (X ranks hold the tokens);
  // with ep over dp replicas the experts spread over ep = K X ranks.
  const bool tsp = plan_strategy(l) == PlanStrategy::kTsp;
  const int X = tsp ? l.tsp : l.tp * l.sp;
  const ShardDims dims = shard_dims(c, tsp ? l.tsp : l.tp, l.expert_ranks());
  if (!tsp || l.expert_replicas() > 1) mp.expert_axis_ranks = l.expert_ranks();
  mp.experts_per_rank = dims.experts;
  mp.ranks_per_expert = dims.expert_group;
  mp.top_k = m.num_experts_per_tok;
  mp.expert_width = m.moe_intermediate_size;
  mp.stage = l.pp > 1 ? stage : -1;
  mp.sparse_layers = sparse_layers_of(c, l, stage);
  const int64_t elements = mp.sparse_layers * dims.experts * 3 * c.hidden_size * dims.expert_rows;
  mp.expert_param_bytes = elements * l.storage_bytes();
  mp.expert_grad_bytes = r.mode == PlanMode::kTrain ? elements * 4 : 0;
  mp.expert_optimizer_bytes = r.mode == PlanMode::kTrain ? elements * 8 : 0;
  const int64_t rows = micro_batch > 0 ? micro_batch : r.batch / l.dp;
  // Generation on tp=N routes every row on every rank (TpStepBase::moe_forward_replicated).
  const bool replicated = !tsp && (r.mode == PlanMode::kPrefill || r.mode == PlanMode::kDecode);
  mp.tokens_per_rank = rows * r.seq / (replicated ? 1 : X);
  mp.imbalance = r.moe_imbalance;
  const int64_t slots = mp.tokens_per_rank * mp.top_k;
  mp.rows_balanced = slots / mp.experts;
  std::vector<int64_t> load(static_cast<size_t>(mp.experts), 0);
  for (int32_t e : planned_moe_routing(mp.tokens_per_rank, mp.top_k, mp.experts, r.moe_imbalance)) ++load[e];
  mp.rows_busiest = *std::max_element(load.begin(), load.end());
  const double factor = r.mode == PlanMode::kTrain ? 2.25 : 1.5;
  mp.ring_break_even_tokens = factor * static_cast<double>(mp.experts * mp.expert_width) /
                              static_cast<double>(mp.top_k * mp.ranks_per_expert);
  // What moe=auto runs without a plan (tsp_moe.cc moe_scheme: the training rule in every
  // mode, over the ranks the dispatch spans: tsp, or with experts over dp replicas the expert
  // group's ep). The Megatron layouts have the all-to-all only.
  mp.formula_choice =
      tsp ? dispatch_name(moe_dispatch_by_bytes(m, mp.tokens_per_rank, l.expert_ranks())) : "a2a";
  return mp;
}

MoeSchemePlan scheme_figures(const LayoutPlan& q, const PlanRequest& r) {
  MoeSchemePlan s;
  s.scheme = dispatch_name(q.layout.moe_dispatch);
  const Layout& l = q.layout;
  s.axis = l.expert_replicas() > 1                   ? "ep"
           : plan_strategy(l) == PlanStrategy::kTsp ? "tsp"
           : l.tp > 1 && l.sp > 1                   ? "ep"
           : l.tp > 1                               ? "tp"
                                                    : "sp";
  for (const AxisTraffic& a : q.traffic.axes)
    if (a.axis == s.axis) s.tsp_bytes_sent = static_cast<int64_t>(a.total().bytes_sent);
  s.step_s = q.time.step_s;
  s.compute_s = q.time.compute_s;
  s.exposed_comm_s = q.time.exposed_comm_s;
  s.memory_total = q.memory.total();
  s.fits = q.memory.total() <= r.hardware.memory_bytes();
  return s;
}

// A MoE model on tsp=D: each scheme (or the one named) by its own dry run; the plan keeps
// the least simulated step time among those that fit (else the least memory).
Status plan_moe(const PlanRequest& r, LayoutPlan& p) {
  // Experts over dp replicas too: each scheme runs over the expert group (the ring's blocks
  // over its ep ranks); the plan names the scheme it keeps, so the runtime runs what it timed.
  // validate_layout's verdict before the expert figures: moe_plan_base's shard_dims takes a
  // degree that divides (a search over many devices offers tsp=D the heads do not divide).
  FP_RETURN_IF_ERROR(validate_layout(r.config, p.layout, r.batch, r.seq));
  std::vector<Layout::MoeDispatchOption> schemes;
  if (p.layout.moe_dispatch == Layout::MoeDispatchOption::kAuto) {
    schemes = {Layout::MoeDispatchOption::kAllToAll, Layout::MoeDispatchOption::kGather,
               Layout::MoeDispatchOption::kRing};
  } else {
    schemes = {p.layout.moe_dispatch};
  }
  std::optional<LayoutPlan> best;
  MoePlan mp = moe_plan_base(r, p.layout, r.micro_batch);
  const int64_t capacity = r.hardware.memory_bytes();
  for (Layout::MoeDispatchOption d : schemes) {
    LayoutPlan q;
    q.layout = p.layout;
    q.layout.moe_dispatch = d;
    FP_RETURN_IF_ERROR(plan_by_dry_run(r, q, r.micro_batch));
    mp.schemes.push_back(scheme_figures(q, r));
    const bool fits = q.memory.total() <= capacity, best_fits = best && best->memory.total() <= capacity;
    if (!best || (fits && (!best_fits || q.time.step_s < best->time.step_s)) ||
        (!fits && !best_fits && q.memory.total() < best->memory.total()))
      best = std::move(q);
  }
  p = std::move(*best);
  mp.chosen = dispatch_name(p.layout.moe_dispatch);
  p.moe = std::move(mp);
  return Status();
}

}  // namespace

std::vector<Layout> candidate_layouts(int devices, int64_t batch, PlanMode mode, int devices_per_node) {
  std::vector<Layout> out;
  auto add = [&](const std::string& text) {
    Result<Layout> s = parse_layout(text);
    if (s.ok()) out.push_back(*s);
  };
  if (mode == PlanMode::kPrefill || mode == PlanMode::kDecode) {
    add(fmt::format("tsp={}", devices));
    add(fmt::format("tp={}", devices));
    return out;
  }
  for (int dp = 1; dp <= devices; ++dp) {
    if (devices % dp != 0 || batch % dp != 0) continue;
    const int m = devices / dp;
    const std::string pre = dp > 1 ? fmt::format("dp={},", dp) : "";
    add(fmt::format("{}tsp={}", pre, m));
    if (m == 1) continue;  // one rank per replica: every layout is the same
    add(fmt::format("{}tp={}", pre, m));
    add(fmt::format("{}tp={}:seqpar", pre, m));
    add(fmt::format("{}sp={}", pre, m));
    add(fmt::format("{}sp={}:ring", pre, m));
    for (int tp = 2; tp < m; ++tp) {
      if (m % tp != 0) continue;
      add(fmt::format("{}tp={},sp={}", pre, tp, m / tp));
      add(fmt::format("{}tp={},sp={}:seqpar", pre, tp, m / tp));
    }
    // A model axis wider than a node: the weight-moving axis inside the node, pipeline
    // stages across nodes (docs/composition.md section 1), where the replica's batch gives
    // every stage a micro-batch.
    const int n = devices_per_node;
    if (n > 1 && m > n && m % n == 0 && batch / dp >= m / n) {
      add(fmt::format("{}pp={},tsp={}", pre, m / n, n));
      add(fmt::format("{}pp={},tp={}", pre, m / n, n));
    }
  }
  return out;
}

std::vector<Layout> expert_group_candidates(const LlamaConfig& config, const Layout& base, int64_t batch,
                                            int64_t seq) {
  std::vector<Layout> out;
  if (!config.moe.enabled() || base.ep > 1) return out;
  // Every K of 2 .. dp is offered to validate_layout, which holds the rules (K divides dp, E
  // divides K G, no ring over them under pp, ...): the search keeps none of its own.
  for (int K = 2; K <= base.dp; ++K) {
    Layout l = base;
    l.ep = K * base.expert_group_ranks();
    if (validate_layout(config, l, batch, seq).ok()) out.push_back(l);
  }
  return out;
}

namespace {

// The layouts the plan makes up (no --layouts): candidate_layouts in the request's dtype and
// recompute, each followed by its expert-group variants on a MoE model.
std::vector<Layout> search_layouts(const PlanRequest& r) {
  std::vector<Layout> out;
  for (Layout l : candidate_layouts(r.devices, r.batch, r.mode, r.hardware.devices_per_node)) {
    l.dtype = r.bf16 ? DType::kBF16 : DType::kF32;
    l.recompute = r.recompute;
    out.push_back(l);
    for (const Layout& e : expert_group_candidates(r.config, l, r.batch, r.seq)) out.push_back(e);
  }
  return out;
}

}  // namespace

Result<PlanReport> make_plan(const PlanRequest& r) {
  if (r.mode != PlanMode::kTrain && r.config.moe.capacity_factor > 0) {
    PlanRequest dropless = r;  // generation routes dropless (app/generate.cc): so does its plan
    dropless.config.moe.capacity_factor = 0.0;
    return make_plan(dropless);
  }
  if (r.devices < 1) return invalid_argument("--devices ({}) must be at least 1", r.devices);
  if (r.batch < 1 || r.seq < 1) return invalid_argument("--batch ({}) and --seq ({}) must be positive", r.batch, r.seq);
  FP_RETURN_IF_ERROR(r.config.validate());
  FP_RETURN_IF_ERROR(r.hardware.validate());
  if (r.seq > r.config.max_position_embeddings)
    return invalid_argument("--seq ({}) exceeds the model's max_position_embeddings ({})", r.seq,
                            r.config.max_position_embeddings);
  PlanReport report;
  report.request = r;
  const std::vector<Layout> layouts = r.layouts.empty() ? search_layouts(r) : r.layouts;
  // The layouts the plan makes up name no schedule: it chooses theirs.
  const bool choose = r.choose_schedule || r.layouts.empty();
  PlanRequest request = r;
  request.choose_schedule = choose;
  for (const Layout& l : layouts) {
    if (l.ranks() != r.devices) {
      report.not_buildable.push_back(fmt::format("{}: uses {} ranks, not {}", l.to_string(), l.ranks(), r.devices));
      continue;
    }
    LayoutPlan p;
    p.layout = l;
    // validate_layout's verdict first (dry_run)
    const bool search = l.pp > 1 && r.mode == PlanMode::kTrain && (r.micro_batch == 0 || choose);
    // A MoE model on tsp=D, D > 1, or with experts over dp replicas (dp=N,tsp=1,ep=K too):
    // each scheme by its own dry run.
    const bool moe = r.config.moe.enabled() && plan_strategy(l) == PlanStrategy::kTsp &&
                     l.ranks() == l.dp * l.tsp && (l.tsp > 1 || l.expert_replicas() > 1);
    Status dry = search ? plan_pipeline(request, p) : moe ? plan_moe(r, p) : plan_by_dry_run(r, p, r.micro_batch);
    if (dry.ok() && r.config.moe.enabled() && plan_strategy(l) != PlanStrategy::kTsp) {
      // Expert parallelism over tp x sp: the expert memory and the one scheme's figures (under
      // pp at the micro-batch the schedule search chose).
      MoePlan mp = moe_plan_base(r, p.layout, l.pp > 1 ? p.micro_batch : r.micro_batch, p.heaviest_stage);
      mp.schemes.push_back(scheme_figures(p, r));
      // Generation (tp=N) runs the replicated form: every rank routes every row.
      const bool generation = r.mode == PlanMode::kPrefill || r.mode == PlanMode::kDecode;
      mp.schemes.back().scheme = mp.chosen = generation ? "replicated" : "a2a";
      p.moe = std::move(mp);
    }
    if (dry.ok() && r.config.moe.enabled() && plan_strategy(l) == PlanStrategy::kTsp && l.pp > 1) {
      // Under pp the schedule and micro-batch search (plan_pipeline) runs the layout's scheme:
      // the one named, else what moe=auto picks at the chosen micro-batch (tsp_moe.cc's rule).
      MoePlan mp = moe_plan_base(r, p.layout, p.micro_batch, p.heaviest_stage);
      mp.schemes.push_back(scheme_figures(p, r));
      mp.schemes.back().scheme = mp.chosen = p.layout.moe_dispatch == Layout::MoeDispatchOption::kAuto
                                                 ? mp.formula_choice
                                                 : dispatch_name(p.layout.moe_dispatch);
      p.moe = std::move(mp);
    }
    if (!dry.ok()) {
      const std::string name = l.to_string();
      const bool named = dry.message().rfind(name, 0) == 0;
      report.not_buildable.push_back(named ? dry.message() : fmt::format("{}: {}", name, dry.message()));
      continue;
    }
    p.over_bytes = p.memory.total() - r.hardware.memory_bytes();
    p.fits = p.over_bytes <= 0;
    report.layouts.push_back(std::move(p));
  }
  if (report.layouts.empty() && !report.not_buildable.empty())
    return invalid_argument("no layout of {} devices can run this model: {}", r.devices, report.not_buildable.front());
  for (size_t i = 0; i < report.layouts.size(); ++i) {
    const LayoutPlan& p = report.layouts[i];
    if (!p.fits) continue;
    if (report.recommended < 0 || p.time.tokens_per_s > report.layouts[report.recommended].time.tokens_per_s)
      report.recommended = static_cast<int>(i);
  }
  return report;
}

std::string plan_report_text(const PlanReport& rep) {
  const PlanRequest& r = rep.request;
  const LlamaConfig& c = r.config;
  std::string s = fmt::format(
      "plan: {} (L={} h={} f={} heads={}/{} V={}), {} B={} S={}{}, {} devices of {} ({} GB each), {}{}\n",
      r.model_name, c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
      c.num_key_value_heads, c.vocab_size, plan_mode_name(r.mode), r.batch, r.seq,
      r.max_new_tokens > 0 ? fmt::format(" (+{} new)", r.max_new_tokens) : "", r.devices, r.hardware.name,
      r.hardware.memory_per_device_gb, r.bf16 ? "bf16" : "f32",
      r.recompute == Recompute::kBlock ? ", recompute block" : "");
  const Unit u = unit_for(rep);
  auto mem = [&](int64_t bytes) { return in_unit(bytes, u); };
  s += fmt::format("memory per rank in {} (live at the step's peak, by category; optimizer state beside it)\n", u.name);
  s += fmt::format("{:<32} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}  {:<21} {:>11} {:>10} {:>11}\n",
                   "layout", "params", "grads", "optim", "activ", "comm", "work", "kvcache", "total", "fits",
                   "sent/step", "step s", "tokens/s");
  for (size_t i = 0; i < rep.layouts.size(); ++i) {
    const LayoutPlan& p = rep.layouts[i];
    const MemoryEstimate& m = p.memory;
    const std::string fits = p.fits ? "yes" : fmt::format("no, over by {} {}", mem(p.over_bytes), u.name);
    const OpBytes t = p.traffic.total();
    s += fmt::format("{:<32} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}  {:<21} {:>11} {:>10.4g} {:>11.4g}{}\n",
                     p.layout.to_string(), mem(m.of(MemCategory::kParameters)), mem(m.of(MemCategory::kGradients)),
                     mem(m.optimizer), mem(m.of(MemCategory::kActivations)), mem(m.of(MemCategory::kComm)),
                     mem(m.of(MemCategory::kWorkspace)), mem(m.of(MemCategory::kKvCache)), mem(m.total()), fits, bytes_text(static_cast<double>(t.bytes_sent)), p.time.step_s,
                     p.time.tokens_per_s, static_cast<int>(i) == rep.recommended ? "  <- recommended" : "");
  }
  for (const LayoutPlan& p : rep.layouts) {
    if (p.layout.pp == 1) continue;
    // The bubble with equal stages: (p - 1) / (m v + p - 1) of the step (1F1B: v = 1), ZB-H1's
    // (p - 1) / (3m + p - 1) with equal F, B and W (parallel/pipeline/pipeline_schedule.h).
    const double pp = p.layout.pp, m = static_cast<double>(p.micro_batches), v = p.layout.chunks;
    const bool zb = p.layout.zero_bubble;
    std::string line = fmt::format(
        "pipeline {}: {} micro-batches of {} (train --micro-batch {}), schedule {}; memory peaks on {}; bubble "
        "{:.4g} s of the busiest stage ({:.0f}% of the step; equal stages{}: (p-1)/({}m{}+p-1) = {:.0f}%)",
        p.layout.to_string(), p.micro_batches, p.micro_batch, p.micro_batch, schedule_name(p.layout), p.memory.phase,
        p.bubble_s, p.time.step_s > 0 ? 100 * p.bubble_s / p.time.step_s : 0.0, zb ? ", F = B = W" : "",
        zb ? "3" : "", v > 1 ? " v" : "", 100 * (pp - 1) / ((zb ? 3 : 1) * m * v + pp - 1));
    if (p.micro_batch_tried.size() > 1) {
      std::vector<std::string> t;
      for (const auto& [micro, tps] : p.micro_batch_tried) t.push_back(fmt::format("{}: {:.4g}", micro, tps));
      line += fmt::format("; tokens/s by micro-batch {}", fmt::join(t, ", "));
    }
    s += line + "\n";
    if (!p.schedule_reason.empty())
      s += fmt::format("schedule {}: {}\n", p.layout.to_string(), p.schedule_reason);
  }
  for (const LayoutPlan& p : rep.layouts) {
    if (!p.moe) continue;
    const MoePlan& m = *p.moe;
    s += fmt::format(
        "moe {}: {} of {} experts per rank (k={}, f_e={}, {} sparse layers{}): expert weights {}, grads {}, optimizer "
        "{} per rank\n",
        p.layout.to_string(),
        m.ranks_per_expert > 1 ? fmt::format("1/{} of one", m.ranks_per_expert) : std::to_string(m.experts_per_rank),
        m.experts, m.top_k, m.expert_width, m.sparse_layers,
        m.stage >= 0 ? fmt::format(" on stage {}, the heaviest", m.stage) : std::string(),
        bytes_text(static_cast<double>(m.expert_param_bytes)), bytes_text(static_cast<double>(m.expert_grad_bytes)),
        bytes_text(static_cast<double>(m.expert_optimizer_bytes)));
    s += fmt::format(
        "  routing assumed (no data in a dry run): {}, every rank alike: T={} tokens per rank, {} rows per expert "
        "balanced, the busiest {}\n",
        m.imbalance > 1 ? fmt::format("expert 0 at {:.3g}x its share", m.imbalance) : std::string("balanced"),
        m.tokens_per_rank, m.rows_balanced, m.rows_busiest);
    if (const int64_t cap = rep.request.config.moe.expert_capacity(rep.request.seq); cap > 0)
      s += fmt::format("  capacity: moe_capacity_factor {} keeps at most {} of a sequence's {} pairs per expert (the "
                       "rest dropped, in the dry run too)\n",
                       rep.request.config.moe.capacity_factor, cap,
                       rep.request.seq * rep.request.config.moe.num_experts_per_tok);
    if (m.expert_axis_ranks > 0) {
      const std::string axis = p.layout.expert_replicas() > 1
                                   ? fmt::format("the expert group over {} dp replicas, ep", p.layout.expert_replicas())
                                   : std::string("tp x sp");
      // On tsp with ep over dp replicas each scheme runs over the group (a2a, gather, ring);
      // the Megatron layouts have the one, the all-to-all.
      for (const MoeSchemePlan& sc : m.schemes)
        s += fmt::format(
            "  {} over the expert axis ({}, {} ranks): {} sent/step {} (attention's included where the axis is tp "
            "or sp itself){}\n",
            sc.scheme == "replicated" ? "replicated (generation: every rank routes every row, one all_reduce over tp)"
                                      : sc.scheme,
            axis, m.expert_axis_ranks, sc.axis, bytes_text(static_cast<double>(sc.tsp_bytes_sent)),
            m.schemes.size() > 1 && sc.scheme == m.chosen ? fmt::format("  step {:.4g} s  <- auto", sc.step_s)
            : m.schemes.size() > 1                        ? fmt::format("  step {:.4g} s", sc.step_s)
                                                          : std::string());
      // TSP: moe=auto's rule over the group's N ranks (tsp_moe.cc moe_scheme).
      if (plan_strategy(p.layout) == PlanStrategy::kTsp)
        s += fmt::format(
            "  auto: {} ({}); without a plan moe=auto (T > 2.25 E f_e / k = {:.4g}: ring, else gather if N < k, "
            "else a2a; N = {} ranks of the expert group) runs {} at T={}\n",
            m.chosen,
            m.schemes.size() > 1 ? "the least simulated step time of the three"
            : p.layout.pp > 1    ? "under pp the schedule search plans one scheme: the one named, else moe=auto's rule"
                                 : "the one named",
            2.25 * static_cast<double>(m.experts * m.expert_width) / static_cast<double>(m.top_k),
            m.expert_axis_ranks, m.formula_choice, m.tokens_per_rank);
      continue;
    }
    for (const MoeSchemePlan& sc : m.schemes)
      s += fmt::format("  {:<7} tsp sent/step {:>11}  step {:.4g} s (compute {:.4g} s, exposed comm {:.4g} s)  {} {}{}\n",
                       sc.scheme, bytes_text(static_cast<double>(sc.tsp_bytes_sent)), sc.step_s, sc.compute_s,
                       sc.exposed_comm_s, bytes_text(static_cast<double>(sc.memory_total)),
                       sc.fits ? "fits" : "does not fit", sc.scheme == m.chosen ? "  <- auto" : "");
    const std::string why = m.schemes.size() > 1 ? "the least simulated step time of the three"
                            : p.layout.pp > 1  ? "under pp the schedule search plans one scheme: the one named, else "
                                                 "moe=auto's rule below"
                                               : "the least simulated step time, the one named";
    s += fmt::format(
        "  auto: {} ({}); the bytes break-even of the ring against a2a is T = {} E f_e / k "
        "= {:.4g} tokens per rank; without a plan moe=auto (T > 2.25 E f_e / k: ring, else gather if D < k, else "
        "a2a) runs {} at T={}\n",
        m.chosen, why,
        r.mode == PlanMode::kTrain ? "2.25" : "1.5", m.ring_break_even_tokens, m.formula_choice, m.tokens_per_rank);
  }
  for (const std::string& n : rep.not_buildable) s += fmt::format("not buildable: {}\n", n);
  if (rep.recommended >= 0) {
    const LayoutPlan& p = rep.layouts[rep.recommended];
    s += fmt::format("recommended: {} (the fastest layout that fits: {:.4g} tokens/s, {} of {} GB per rank)\n",
                     p.layout.to_string(), p.time.tokens_per_s, bytes_text(static_cast<double>(p.memory.total())),
                     r.hardware.memory_per_device_gb);
  } else {
    s += "recommended: none fits; raise --devices, lower --seq or --batch, or plan with --recompute block or --bf16\n";
  }
  return s;
}

std::string plan_report_json(const PlanReport& rep) {
  const PlanRequest& r = rep.request;
  nlohmann::ordered_json j;
  j["model"] = r.model_name;
  j["mode"] = plan_mode_name(r.mode);
  j["batch"] = r.batch;
  j["seq"] = r.seq;
  j["devices"] = r.devices;
  j["hardware"] = r.hardware.name;
  j["memory_per_device_bytes"] = r.hardware.memory_bytes();
  j["dtype"] = r.bf16 ? "bf16" : "f32";
  j["recompute"] = r.recompute == Recompute::kBlock ? "block" : "none";
  j["layouts"] = nlohmann::json::array();
  for (const LayoutPlan& p : rep.layouts) {
    nlohmann::ordered_json l;
    l["layout"] = p.layout.to_string();
    nlohmann::ordered_json mem;
    for (int i = 0; i < kNumMemCategories; ++i)
      mem[std::string(mem_category_name(static_cast<MemCategory>(i)))] = p.memory.at_peak[i];
    mem["peak"] = p.memory.peak;
    mem["optimizer_state"] = p.memory.optimizer;
    mem["total"] = p.memory.total();
    mem["peak_phase"] = p.memory.phase;
    l["memory_bytes"] = mem;
    l["fits"] = p.fits;
    l["over_bytes"] = std::max<int64_t>(0, p.over_bytes);
    nlohmann::ordered_json tr = nlohmann::json::object();
    for (const AxisTraffic& a : p.traffic.axes) {
      nlohmann::ordered_json ax;
      for (int i = 0; i < kNumPlanOps; ++i) {
        const OpBytes& o = a.ops[i];
        if (o.calls == 0 && o.bytes_sent == 0) continue;
        ax[plan_op_name(static_cast<PlanOp>(i))] = {
            {"calls", o.calls}, {"bytes_sent", o.bytes_sent}, {"bytes_received", o.bytes_received}};
      }
      ax["link"] = axis_inside_node(p.layout, a.axis, r.hardware.devices_per_node) ? "intra_node" : "inter_node";
      tr[a.axis] = ax;
    }
    l["traffic"] = tr;
    l["traffic_bytes_sent"] = p.traffic.total().bytes_sent;
    l["time"] = {{"compute_s", p.time.compute_s},           {"intra_node_s", p.time.intra_node_s},
                 {"inter_node_s", p.time.inter_node_s},     {"exposed_comm_s", p.time.exposed_comm_s},
                 {"step_s", p.time.step_s},                 {"tokens_per_s", p.time.tokens_per_s}};
    if (p.layout.pp > 1) {
      nlohmann::ordered_json tried = nlohmann::json::array();
      for (const auto& [micro, tps] : p.micro_batch_tried) tried.push_back({{"micro_batch", micro}, {"tokens_per_s", tps}});
      l["pipeline"] = {{"micro_batches", p.micro_batches}, {"micro_batch", p.micro_batch}, {"schedule", schedule_name(p.layout)},
                       {"heaviest_stage", p.heaviest_stage}, {"bubble_s", p.bubble_s}, {"micro_batch_tried", tried}};
      if (!p.schedule_tried.empty()) {
        nlohmann::ordered_json sched = nlohmann::ordered_json::array();
        for (const LayoutPlan::ScheduleTry& t : p.schedule_tried)
          sched.push_back({{"schedule", t.schedule}, {"micro_batch", t.micro_batch}, {"micro_batches", t.micro_batches},
                           {"tokens_per_s", t.tokens_per_s}, {"bubble_s", t.bubble_s}, {"step_s", t.step_s},
                           {"memory_bytes", t.memory}, {"fits", t.fits}});
        l["pipeline"]["schedule_tried"] = sched;
        l["pipeline"]["schedule_reason"] = p.schedule_reason;
      }
    }
    if (p.moe) {
      const MoePlan& m = *p.moe;
      nlohmann::ordered_json schemes = nlohmann::json::array();
      for (const MoeSchemePlan& sc : m.schemes)
        schemes.push_back({{"scheme", sc.scheme}, {"axis", sc.axis}, {"tsp_bytes_sent", sc.tsp_bytes_sent}, {"step_s", sc.step_s},
                           {"compute_s", sc.compute_s}, {"exposed_comm_s", sc.exposed_comm_s},
                           {"memory_total_bytes", sc.memory_total}, {"fits", sc.fits}});
      l["moe"] = {{"experts", m.experts},
                  {"expert_axis_ranks", m.expert_axis_ranks},
                  {"experts_per_rank", m.experts_per_rank},
                  {"ranks_per_expert", m.ranks_per_expert},
                  {"top_k", m.top_k},
                  {"expert_intermediate_size", m.expert_width},
                  {"sparse_layers", m.sparse_layers},
                  {"stage", m.stage},
                  {"expert_param_bytes", m.expert_param_bytes},
                  {"expert_grad_bytes", m.expert_grad_bytes},
                  {"expert_optimizer_bytes", m.expert_optimizer_bytes},
                  {"routing", m.imbalance > 1 ? "imbalanced" : "balanced"},
                  {"imbalance", m.imbalance},
                  {"tokens_per_rank", m.tokens_per_rank},
                  {"rows_per_expert_balanced", m.rows_balanced},
                  {"rows_busiest_expert", m.rows_busiest},
                  {"schemes", schemes},
                  {"auto", m.chosen},
                  {"ring_break_even_tokens", m.ring_break_even_tokens},
                  {"formula_choice", m.formula_choice}};
    }
    j["layouts"].push_back(l);
  }
  j["not_buildable"] = rep.not_buildable;
  j["recommended"] = rep.recommended >= 0 ? nlohmann::json(rep.layouts[rep.recommended].layout.to_string()) : nlohmann::json();
  return j.dump(2) + "\n";
}

double moe_imbalance_of_load(const std::vector<int64_t>& load, int64_t ranks, int64_t top_k) {
  const int64_t E = static_cast<int64_t>(load.size());
  int64_t total = 0;
  for (int64_t n : load) total += n;
  if (E < 2 || ranks < 2 || total <= 0 || top_k < 1 || top_k >= E) return 1.0;
  const int64_t m = std::max<int64_t>(1, E / ranks);  // experts per rank
  if (m >= E) return 1.0;
  // Split experts (ranks > E): each of an expert's ranks computes its slice over all of its
  // rows, so the busiest rank's share follows the busiest expert's.
  double busiest = 0;
  for (int64_t e0 = 0; e0 < E; e0 += m) {
    int64_t rows = 0;
    for (int64_t e = e0; e < e0 + m; ++e) rows += load[static_cast<size_t>(e)];
    busiest = std::max(busiest, static_cast<double>(rows));
  }
  const double R = busiest / (static_cast<double>(total) * static_cast<double>(m) / static_cast<double>(E));
  const double x = (R * static_cast<double>(m * (E - 1)) - static_cast<double>((m - 1) * E)) / static_cast<double>(E - m);
  return std::clamp(x, 1.0, static_cast<double>(E) / static_cast<double>(top_k));
}

}  // namespace foldpar
