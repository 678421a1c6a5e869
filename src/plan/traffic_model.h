// The plan's traffic tables: calls and bytes per rank, per parallel axis and operation kind,
// in the counting convention of comm/comm_stats.h (what a forward ring or chain moves; a
// broadcast of n costs every rank but the root n received; an all_reduce of n over N ranks
// is 2n - b[p] - b[next] sent and 2n - b[prev] - b[p] received with b the ring blocks). The
// model axes' figures are the counting communicators' of a dry run (plan/dry_run.h); the
// only term written here is the trainer's dp gradient all_reduce, which is not part of the
// model step. Also the byte-free per-layer formulas of docs/tsp.md section 7, which
// plan_test holds to the dry run's counted bytes. Pure arithmetic: no MPI.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "model/llama_config.h"
#include "plan/layout_spec.h"

namespace foldpar {

// The operation kinds the strategies use; names as comm_op_name() spells them.
enum class PlanOp { kBroadcast, kReduce, kAllReduce, kAllGather, kReduceScatter, kAllToAll, kSendRecv };
inline constexpr int kNumPlanOps = 7;
const char* plan_op_name(PlanOp op);

struct OpBytes {
  uint64_t calls = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
};

// One axis's counters (the communicator of that axis).
struct AxisTraffic {
  std::string axis;  // "tsp", "tp", "sp", "dp"
  int degree = 1;
  std::array<OpBytes, kNumPlanOps> ops{};

  const OpBytes& op(PlanOp k) const { return ops[static_cast<int>(k)]; }
  OpBytes total() const;
  // An all_reduce of n elements over this axis, for coordinate p (the ring-block rule).
  void add_all_reduce(uint64_t calls, uint64_t n, int p, uint64_t bytes_per);
};

enum class PlanMode {
  kTrain,    // forward + backward of one micro-batch (no optimizer traffic; dp below)
  kForward,  // forward with the loss (evaluation)
  kPrefill,  // generation's prefill (forward without the head), tsp and tp
  kDecode,   // one decode step of B tokens, tsp and tp
};
const char* plan_mode_name(PlanMode m);

struct StepTraffic {
  std::vector<AxisTraffic> axes;  // model axes first, then dp (training only)
  const AxisTraffic* axis(const std::string& name) const;
  OpBytes total() const;  // summed over axes and kinds
};

// The trainer's data-parallel gradient sum of one step, as rank 0 of the dp axis counts it:
// every local gradient (f32) summed over dp, taken as one all_reduce of all of them (the
// per-tensor calls differ from it only by the ring blocks' rounding), on pipeline stage
// `stage`. layout.dp > 1.
// Experts over dp replicas (a MoE model with Layout::ep = K G, K > 1): the routed experts'
// gradients sum over the dp/K replicas holding them instead, so this is the rest over dp
// (the dense formula's sparse-layer MLPs replaced by their routers and shared experts) and
// expert_dp_gradient_traffic the experts' part over "edp"; under pp both of stage `stage`'s
// sparse layers (each stage sums its own over its own replicas).
AxisTraffic dp_gradient_traffic(const LlamaConfig& config, const Layout& layout, int stage = 0);
AxisTraffic expert_dp_gradient_traffic(const LlamaConfig& config, const Layout& layout, int stage = 0);

// A MoE model's sparse layers, or under pp (stage >= 0) those of pipeline stage `stage` (its
// chunks g with g % p == stage, of stage_bounds).
int64_t sparse_layers_of(const LlamaConfig& config, const Layout& layout, int stage);

// docs/tsp.md section 7, forward, per layer per rank, in elements: the byte-free formulas the
// crossover is read from. TSP: weights (2 + 2/g) h^2 (D-1)/D + 3 h f (D-1)/D plus K/V
// 2 B S h/g (D-1)/D; TP: 4 B S h (tp-1)/tp. With KV replicas (n_kv < D) each shard carries one
// KV head: the weight term's 2h^2/g (D-1)/D becomes 2 d h (D-1); the K/V term is unchanged.
double tsp_forward_layer_elements(const LlamaConfig& c, int64_t tokens, int degree);
double tp_forward_layer_elements(const LlamaConfig& c, int64_t tokens, int degree);
// The B*S above which TSP moves fewer forward bytes per layer than TP at the same degree:
// ((2+2/g) h + 3 f) / (4 - 2/g); 8h for g = 1, f = 4h.
double tsp_tp_forward_crossover_tokens(const LlamaConfig& c);

}  // namespace foldpar
