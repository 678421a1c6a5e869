// The planner: for a model, a micro-batch and N devices of a described machine, every
// layout foldpar can run (or those asked for) with its memory per rank by category
// (plan/memory_model.h), its traffic per step (plan/traffic_model.h) and a step-time
// estimate, and the fastest layout that fits. `foldpar plan` prints it.
//
// Step time: compute = FLOPs per rank (model/flop_count.h, split evenly over the model
// ranks; recompute adds a forward): the GEMMs' / (peak x matmul_efficiency) plus
// attention's / (peak x attention_efficiency), which differ most at long S where causal
// attention is most of the work; each axis's traffic moves
// over the intra-node links when the axis's rank group fits inside a node (mesh order: dp
// outermost, the last-written model axis innermost), else over the NICs, at max(bytes sent,
// received) / bandwidth; traffic the schedule overlaps (TSP's shards, rings and K/V; SP's
// K/V; TP's backward dX all-reduces) is hidden behind compute up to overlap_efficiency;
// the rest adds. Decode: max(compute, weights and cache read once from device memory).
#pragma once

#include <string>
#include <vector>

#include "model/llama_config.h"
#include "plan/hardware.h"
#include "plan/timeline.h"
#include "plan/layout_spec.h"
#include "plan/memory_model.h"
#include "plan/traffic_model.h"

namespace foldpar {

struct PlanRequest {
  LlamaConfig config;
  std::string model_name;  // for the report
  Hardware hardware;
  int devices = 1;         // N: ranks of the job
  int64_t batch = 1;       // B: sequences per step (global; split over dp)
  int64_t seq = 0;         // S (decode: tokens already in the cache)
  PlanMode mode = PlanMode::kTrain;
  bool bf16 = false;       // storage of weights and activations (every layout)
  Recompute recompute = Recompute::kNone;
  int64_t max_new_tokens = 0;       // prefill, decode: the cache is planned for S + this
  std::vector<Layout> layouts;  // empty: every layout of `devices` ranks
};

struct TimeEstimate {
  double compute_s = 0;
  double intra_node_s = 0;  // traffic time on intra-node links
  double inter_node_s = 0;  // traffic time on the NICs
  double exposed_comm_s = 0;
  double step_s = 0;
  double tokens_per_s = 0;
};

struct LayoutPlan {
  Layout layout;
  MemoryEstimate memory;
  StepTraffic traffic;
  TimeEstimate time;
  // How the figures were obtained: "dry run" (the strategy's own code on the meta backend
  // and a counting mesh, plan/dry_run.h, timed by plan/timeline.h) or "replay" (the
  // hand-written replays, plan/memory_model.h, and estimate_time: bf16 layouts, whose
  // storage decorator still widens on the host).
  std::string source;
  std::vector<RankTimeline> timelines;  // dry run: one per distinct rank simulated
  bool fits = false;
  int64_t over_bytes = 0;  // total() - capacity when it does not fit
};

struct PlanReport {
  PlanRequest request;
  std::vector<LayoutPlan> layouts;
  std::vector<std::string> not_buildable;  // "tp=8: num_key_value_heads (4) must be ..."
  int recommended = -1;                    // index into layouts, -1 when none fits
};

// Every model layout of `devices` ranks, with dp where the batch divides: tsp=m, tp=m,
// tp=m:seqpar, sp=m, sp=m:ring and each tp=N,sp=M (N*M = m, with and without seqpar).
// Prefill and decode: tsp=N and tp=N only.
std::vector<Layout> candidate_layouts(int devices, int64_t batch, PlanMode mode);

TimeEstimate estimate_time(const LlamaConfig& config, const Layout& layout, const Hardware& hardware,
                           const PlanRequest& request, const StepTraffic& traffic, const MemoryEstimate& memory);

// invalid_argument for a request no layout could satisfy (devices < 1, bad sizes) naming
// the values; layouts that do not divide are listed in not_buildable.
Result<PlanReport> make_plan(const PlanRequest& request);

std::string plan_report_text(const PlanReport& report);
std::string plan_report_json(const PlanReport& report);

}  // namespace foldpar
