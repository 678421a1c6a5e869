// The traffic tables' arithmetic, the dp gradient term and the spec's per-layer formulas
// (traffic_model.h).
#include "plan/traffic_model.h"

namespace foldpar {

const char* plan_op_name(PlanOp op) {
  switch (op) {
    case PlanOp::kBroadcast: return "broadcast";
    case PlanOp::kReduce: return "reduce";
    case PlanOp::kAllReduce: return "all_reduce";
    case PlanOp::kAllGather: return "all_gather";
    case PlanOp::kReduceScatter: return "reduce_scatter";
    case PlanOp::kAllToAll: return "all_to_all";
    case PlanOp::kSendRecv: return "send_recv";
  }
  return "?";
}

const char* plan_mode_name(PlanMode m) {
  switch (m) {
    case PlanMode::kTrain: return "train";
    case PlanMode::kForward: return "forward";
    case PlanMode::kPrefill: return "prefill";
    case PlanMode::kDecode: return "decode";
  }
  return "?";
}

OpBytes AxisTraffic::total() const {
  OpBytes t;
  for (const OpBytes& o : ops) {
    t.calls += o.calls;
    t.bytes_sent += o.bytes_sent;
    t.bytes_received += o.bytes_received;
  }
  return t;
}

void AxisTraffic::add_all_reduce(uint64_t calls, uint64_t n, int p, uint64_t bytes_per) {
  OpBytes& o = ops[static_cast<int>(PlanOp::kAllReduce)];
  o.calls += calls;
  const int N = degree;
  if (N <= 1) return;
  auto block = [&](int i) { return n / N + (static_cast<uint64_t>(i) < n % N ? 1 : 0); };
  const int next = (p + 1) % N, prev = (p - 1 + N) % N;
  o.bytes_sent += (2 * n - block(p) - block(next)) * bytes_per;
  o.bytes_received += (2 * n - block(prev) - block(p)) * bytes_per;
}

const AxisTraffic* StepTraffic::axis(const std::string& name) const {
  for (const AxisTraffic& a : axes)
    if (a.axis == name) return &a;
  return nullptr;
}

OpBytes StepTraffic::total() const {
  OpBytes t;
  for (const AxisTraffic& a : axes) {
    const OpBytes x = a.total();
    t.calls += x.calls;
    t.bytes_sent += x.bytes_sent;
    t.bytes_received += x.bytes_received;
  }
  return t;
}

int64_t sparse_layers_of(const LlamaConfig& c, const Layout& l, int stage) {
  if (l.pp == 1 || stage < 0) return c.moe.sparse_layer_count(c.num_hidden_layers);
  const std::vector<int64_t> bounds = stage_bounds(c, l);
  int64_t n = 0;
  for (size_t g = 0; g + 1 < bounds.size(); ++g)
    if (static_cast<int>(g % static_cast<size_t>(l.pp)) == stage)
      for (int64_t i = bounds[g]; i < bounds[g + 1]; ++i) n += c.moe.is_sparse_layer(i) ? 1 : 0;
  return n;
}

namespace {

// Experts over dp replicas: a rank's routed-expert elements (E/ep whole experts per sparse
// layer of its pipeline stage, validate_layout) and its other sparse-layer elements (the
// router and the shared expert with its gate, replicated), against the dense formula's MLP
// in those layers.
struct ExpertElements {
  int64_t experts = 0, replicated = 0, dense_mlp = 0;
};
ExpertElements expert_elements(const LlamaConfig& c, const Layout& l, int stage) {
  const MoeConfig& m = c.moe;
  const int64_t sparse = sparse_layers_of(c, l, stage), h = c.hidden_size;
  const int64_t fs = m.shared_expert_intermediate_size;
  return ExpertElements{sparse * (m.num_experts / l.expert_ranks()) * 3 * m.moe_intermediate_size * h,
                        sparse * (m.num_experts * h + (fs > 0 ? 3 * fs * h + h : 0)),
                        sparse * 3 * h * c.intermediate_size / l.weight_degree()};
}

bool experts_over_dp(const LlamaConfig& c, const Layout& l) { return c.moe.enabled() && l.expert_replicas() > 1; }

}  // namespace

AxisTraffic dp_gradient_traffic(const LlamaConfig& c, const Layout& l, int stage) {
  AxisTraffic dp{"dp", l.dp, {}};
  int64_t n = local_parameter_elements(c, l, stage);
  if (experts_over_dp(c, l)) {
    const ExpertElements e = expert_elements(c, l, stage);
    n += e.replicated - e.dense_mlp;
  }
  dp.add_all_reduce(1, static_cast<uint64_t>(n), 0, 4);
  return dp;
}

AxisTraffic expert_dp_gradient_traffic(const LlamaConfig& c, const Layout& l, int stage) {
  AxisTraffic edp{"edp", l.dp / l.expert_replicas(), {}};
  if (experts_over_dp(c, l))
    edp.add_all_reduce(1, static_cast<uint64_t>(expert_elements(c, l, stage).experts), 0, 4);
  return edp;
}

double tsp_forward_layer_elements(const LlamaConfig& c, int64_t tokens, int degree) {
  const double D = degree, h = static_cast<double>(c.hidden_size), f = static_cast<double>(c.intermediate_size),
               g = static_cast<double>(c.group()), frac = (D - 1) / D;
  const double q = static_cast<double>(c.q_dim());  // n_h * d (= h unless head_dim is set)
  // A shard's K/V rows: n_kv d / D, or one KV head's d when n_kv < D (KV replicas: every
  // shard carries its replica, (2 + 2/g) h q (D-1)/D becoming (2q/D + 2d) h (D-1)). The K/V
  // all-gather moves each KV head once either way: 2 tokens n_kv d (D-1)/D.
  const double n_kv = static_cast<double>(c.num_key_value_heads), d = static_cast<double>(c.head_dim());
  const double kv_shard = n_kv < D ? d : n_kv * d / D;
  return (2 * q / D + 2 * kv_shard) * h * (D - 1) + 3 * h * f * frac + 2 * static_cast<double>(tokens) * q / g * frac;
}

double tp_forward_layer_elements(const LlamaConfig& c, int64_t tokens, int degree) {
  const double tp = degree;
  return 4 * static_cast<double>(tokens) * static_cast<double>(c.hidden_size) * (tp - 1) / tp;
}

double tsp_tp_forward_crossover_tokens(const LlamaConfig& c) {
  const double h = static_cast<double>(c.hidden_size), f = static_cast<double>(c.intermediate_size),
               g = static_cast<double>(c.group());
  return ((2 + 2 / g) * h + 3 * f) / (4 - 2 / g);
}

}  // namespace foldpar
