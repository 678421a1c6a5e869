// Predicted traffic of one step per rank, per parallel axis and operation kind, in the
// counting convention of comm/comm_stats.h (what a forward ring or chain moves; a
// broadcast of n costs every rank but the root n received; an all_reduce of n over N ranks
// is 2n - b[p] - b[next] sent and 2n - b[prev] - b[p] received with b the ring blocks).
// The terms are those the traffic tests hold the strategies to (tests/parallel/
// *_traffic_test.cc and the formulas written in parallel/*/..._model.h); plan_validation_test
// holds this model to the counters of whole steps. Pure arithmetic: no MPI.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
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
  // A term every rank sends and receives alike: `elements` of `bytes_per` each.
  void add(PlanOp kind, uint64_t calls, uint64_t elements, uint64_t bytes_per);
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

// Where the rank sits on each axis; the ring-block rule of all_reduce depends on it.
struct RankCoords {
  int tp = 0, sp = 0, tsp = 0, dp = 0;
};

struct StepTraffic {
  std::vector<AxisTraffic> axes;  // model axes first, then dp (training only)
  const AxisTraffic* axis(const std::string& name) const;
  OpBytes total() const;  // summed over axes and kinds
};

// invalid_argument for a mode the layout does not run (prefill, decode: tsp and tp only)
// and for sizes that do not divide (naming the numbers).
Result<StepTraffic> predict_traffic(const LlamaConfig& config, const Layout& layout, int64_t batch, int64_t seq,
                                    PlanMode mode, const RankCoords& coords = {});

// docs/tsp.md section 7, forward, per layer per rank, in elements: the byte-free formulas the
// crossover is read from. TSP: weights (2 + 2/g) h^2 (D-1)/D + 3 h f (D-1)/D plus K/V
// 2 B S h/g (D-1)/D; TP: 4 B S h (tp-1)/tp.
double tsp_forward_layer_elements(const LlamaConfig& c, int64_t tokens, int degree);
double tp_forward_layer_elements(const LlamaConfig& c, int64_t tokens, int degree);
// The B*S above which TSP moves fewer forward bytes per layer than TP at the same degree:
// ((2+2/g) h + 3 f) / (4 - 2/g); 8h for g = 1, f = 4h.
double tsp_tp_forward_crossover_tokens(const LlamaConfig& c);

}  // namespace foldpar
