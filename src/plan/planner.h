// The planner: for a model, a micro-batch and N devices of a described machine, every
// layout foldpar can run (or those asked for) with its memory per rank by category, its
// traffic per step and its step time, and the fastest layout that fits. `foldpar plan`
// prints it.
//
// Every figure comes from a dry run of the layout's own code (plan/dry_run.h: the meta
// backend, a counting mesh, storage-less tensors) as its first and last rank, the worst of
// each: memory is the tracker's peak with its breakdown at that moment, traffic the axis
// communicators' counters, and step time the two-stream timeline (plan/timeline.h) of the
// step's records priced by the hardware file. bf16 layouts run on a backend that stores
// bf16 natively where the hardware file states a bf16 rate (the GPUs': the CUDA backend),
// else through the CPU's bf16 storage decorator (DryRunOptions::bf16_native). Training
// adds the trainer's dp gradient all_reduce (traffic_model.h) after the backward; AdamW's
// state is reported beside the peak. A layout whose code refuses the request (validate_layout, a strategy's own
// refusal such as bf16 storage outside tsp) is listed as not buildable with its message.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "model/llama_config.h"
#include "plan/hardware.h"
#include "plan/timeline.h"
#include "plan/layout_spec.h"
#include "plan/traffic_model.h"
#include "tensor/memory_tracker.h"

namespace foldpar {

// Memory per rank: what foldpar's own code allocates through the tracked allocator
// (tensor/memory_tracker.h), by category, at the peak of one step: requested bytes of live
// tensors; not the allocator's cache, not MPI's internal buffers, not the program text. The
// optimizer's AdamW moments (and f32 master weights under bf16) live across steps and are
// reported beside the step's peak; `total()` adds them.
struct MemoryEstimate {
  // Bytes live in each category (MemCategory order) at the peak of the step.
  std::array<int64_t, kNumMemCategories> at_peak{};
  int64_t peak = 0;       // the step's tracked peak: sum of at_peak
  int64_t optimizer = 0;  // AdamW m and v (f32), plus f32 master weights under bf16
  std::string phase;      // which dry-run rank the peak is from, e.g. "rank 7"

  int64_t of(MemCategory c) const { return at_peak[static_cast<int>(c)]; }
  // What must fit on the device: the step's peak plus the optimizer state (training).
  int64_t total() const { return peak + optimizer; }
};

struct PlanRequest {
  LlamaConfig config;
  std::string model_name;  // for the report
  Hardware hardware;
  int devices = 1;         // N: ranks of the job
  int64_t batch = 1;       // B: sequences per step (global; split over dp)
  int64_t seq = 0;         // S (decode: tokens already in the cache)
  PlanMode mode = PlanMode::kTrain;
  bool bf16 = false;       // storage of weights and activations (every layout; tsp runs it)
  Recompute recompute = Recompute::kNone;
  int64_t max_new_tokens = 0;       // prefill, decode: the cache is planned for S + this
  // bf16 layouts: whether the backend stores bf16 itself and multiplies it
  // (DryRunOptions::bf16_native, matmul_takes_bf16). Unset: from the hardware file, both
  // true where it states a bf16 rate. A caller that measures on a known backend sets them.
  std::optional<bool> bf16_native, matmul_takes_bf16;
  std::vector<Layout> layouts;  // empty: every layout of `devices` ranks
  // Training: sequences per forward per data-parallel rank (train --micro-batch). 0: all of
  // them (one micro-batch), except on a pipeline, which is planned at every size that gives
  // at least p micro-batches and keeps the fastest that fits (more micro-batches shrink the
  // bubble; TSP and tp move their weights once per micro-batch).
  int64_t micro_batch = 0;
  // Training, a pipeline whose layout names no schedule (no :interleaved=V, no :zb): plan
  // 1F1B, interleaved with v = 2 and ZB-H1 too, each where validate_layout accepts it, with
  // each micro-batch size, and keep the fastest that fits (plan --choose-schedule; always
  // for the layouts the plan makes up itself, without `layouts`).
  bool choose_schedule = false;
  // MoE models: the routing the dry run assumes (DryRunOptions::moe_imbalance): 1 balanced,
  // X > 1 expert 0 X times its balanced share on every rank (plan --moe-imbalance).
  double moe_imbalance = 1.0;
};

struct TimeEstimate {
  double compute_s = 0;
  double intra_node_s = 0;  // traffic time on intra-node links
  double inter_node_s = 0;  // traffic time on the NICs
  double exposed_comm_s = 0;
  double step_s = 0;
  double tokens_per_s = 0;
};

// A MoE model on a tsp=D layout: the expert part of the memory per rank and each dispatch
// scheme of tsp_moe.cc planned by its own dry run (PlanRequest::moe_imbalance's routing). On
// the Megatron layouts (tp, sp, tp x sp: expert parallelism over the tp x sp group) the same
// figures for the one scheme they run, the all-to-all.
struct MoeSchemePlan {
  std::string scheme;           // "a2a", "gather", "ring"
  int64_t tsp_bytes_sent = 0;   // the expert axis's bytes of the step (the worst rank's): tsp, or on the Megatron
                                // layouts the tp x sp group's ("tp", "sp" or "ep", where attention's add in too)
  std::string axis = "tsp";     // the communicator those bytes are counted on
  double step_s = 0, compute_s = 0, exposed_comm_s = 0;
  int64_t memory_total = 0;     // MemoryEstimate::total() of the worst rank
  bool fits = false;
};
struct MoePlan {
  int64_t experts = 0, experts_per_rank = 0, top_k = 0, expert_width = 0;  // E, E/D (1 when D > E), k, f_e
  int64_t ranks_per_expert = 1;  // D/E when D > E (each rank holds a 1/(D/E) slice of f_e), else 1
  int64_t sparse_layers = 0;  // the model's; under pp, those of the heaviest stage (its chunks)
  int stage = -1;              // under pp: that stage; -1 without pp
  // The routed experts this rank owns, over those sparse layers: f32 weights, gradients,
  // AdamW m and v (the router and the shared expert are replicated and not counted here).
  int64_t expert_param_bytes = 0, expert_grad_bytes = 0, expert_optimizer_bytes = 0;
  int64_t tokens_per_rank = 0;        // T = B * S / D (per micro-batch)
  double imbalance = 1.0;             // the routing assumption
  int64_t rows_balanced = 0;          // T * k / E per expert per rank
  int64_t rows_busiest = 0;           // the busiest expert's rows per rank under the assumption
  // The bytes break-even of spec COMPOSITION.md 3: the ring moves fewer bytes than the
  // all-to-all iff T > this (2.25 E f_e / (k G) training, 1.5 E f_e / (k G) forward, G the
  // ranks per expert); and what
  // moe=auto runs without a plan at this T (moe_dispatch_by_bytes, the training rule, over the
  // expert ranks: tsp, or ep when the experts spread over dp replicas).
  double ring_break_even_tokens = 0;
  std::string formula_choice;
  std::vector<MoeSchemePlan> schemes;  // each planned scheme
  std::string chosen;                  // the least simulated step time among those that fit
  // The Megatron layouts' expert parallelism (parallel/megatron/tp_moe.cc): the experts over
  // the tp x sp group of expert_axis_ranks ranks, one scheme: a2a, or for generation on tp=N
  // "replicated" (every rank routes every row: tokens_per_rank all of them); 0 on tsp.
  int expert_axis_ranks = 0;
};

struct LayoutPlan {
  Layout layout;
  MemoryEstimate memory;
  StepTraffic traffic;
  TimeEstimate time;
  std::vector<RankTimeline> timelines;  // one per distinct rank simulated
  // Training: the micro-batches per data-parallel rank and their size (sequences).
  int64_t micro_batches = 1, micro_batch = 0;
  // pp > 1: the stage whose rank peaks highest (memory), and the time the rank with the most
  // compute idles for want of its neighbour stages (the bubble: the step less its compute
  // and its other waits).
  int heaviest_stage = 0;
  double bubble_s = 0;
  // pp > 1 without PlanRequest::micro_batch: every micro-batch size planned (sequences,
  // tokens/s), the chosen one among them; its figures are this plan's.
  std::vector<std::pair<int64_t, double>> micro_batch_tried;
  // A pipeline whose schedule the plan chose (PlanRequest::choose_schedule): each schedule
  // tried, at its best micro-batch size (the fastest that fits, else the smallest), and
  // what ruled out those not chosen (in schedule_reason).
  struct ScheduleTry {
    std::string schedule;   // as train --schedule spells it
    int64_t micro_batch = 0, micro_batches = 0;
    double tokens_per_s = 0, bubble_s = 0, step_s = 0;
    int64_t memory = 0;     // the heaviest stage's total
    bool fits = false;
  };
  std::vector<ScheduleTry> schedule_tried;
  std::string schedule_reason;  // why the chosen schedule: bubble, memory
  bool fits = false;
  int64_t over_bytes = 0;  // total() - capacity when it does not fit
  // MoE models on tsp: the schemes planned. A layout asked for with moe=auto (the default)
  // plans a2a, gather and ring and keeps the one with the least simulated step time that
  // fits (this plan's figures and layout are that scheme's: tsp=D:moe=ring); one named
  // moe=X plans X alone.
  std::optional<MoePlan> moe;
};

struct PlanReport {
  PlanRequest request;
  std::vector<LayoutPlan> layouts;
  std::vector<std::string> not_buildable;  // "tp=8: num_key_value_heads (4) must be ..."
  int recommended = -1;                    // index into layouts, -1 when none fits
};

// Every model layout of `devices` ranks, with dp where the batch divides: tsp=m, tp=m,
// tp=m:seqpar, sp=m, sp=m:ring and each tp=N,sp=M (N*M = m, with and without seqpar).
// Where the model axis m spans several nodes of `devices_per_node` (m > n, n divides m) and
// each replica's batch has at least m/n sequences: also pp=m/n with tsp=n and with tp=n,
// the weight-moving axis inside a node and the stages across nodes. Prefill and decode:
// tsp=N and tp=N only. Other pipelined layouts are planned when named (PlanRequest::layouts).
// Model-free: a MoE model's experts over dp replicas are expert_group_candidates' (below).
std::vector<Layout> candidate_layouts(int devices, int64_t batch, PlanMode mode, int devices_per_node = 0);

// A MoE model's experts over dp replicas for the search: `base` (a candidate with dp > 1)
// with ep = K G for each K in 2 .. dp that validate_layout(config, _, batch, seq) accepts,
// G its model group (tsp=D: D; tp x sp: T Q); that is, K divides dp, E divides K G, no pp,
// no moe=ring. Empty for a dense model, a base with ep set, or dp = 1. make_plan plans these
// after their base when it makes up the layouts (no PlanRequest::layouts).
std::vector<Layout> expert_group_candidates(const LlamaConfig& config, const Layout& base, int64_t batch,
                                            int64_t seq);

// The routing a plan should assume (PlanRequest::moe_imbalance) to reproduce a measured one:
// `load` the tokens each of the E experts received (StepResult::expert_load), the experts
// spread contiguously over `ranks` ranks (E/ranks each, or ranks/E ranks per expert). Returns
// the X of planned_moe_routing whose busiest rank gets the measured busiest rank's share of
// the rows: R = max over ranks of its experts' load / the mean per rank, then
// X = (R m (E-1) - (m-1) E) / (E - m) with m = max(1, E / ranks) experts per rank (X = R when
// m = 1), clamped to [1, E / k] (expert 0 on every token at most). 1 for an empty load, one
// rank, or k >= E (every token on every expert: no imbalance to plan).
double moe_imbalance_of_load(const std::vector<int64_t>& load, int64_t ranks, int64_t top_k);

// invalid_argument for a request no layout could satisfy (devices < 1, bad sizes) naming
// the values; layouts that do not divide are listed in not_buildable.
Result<PlanReport> make_plan(const PlanRequest& request);

std::string plan_report_text(const PlanReport& report);
std::string plan_report_json(const PlanReport& report);

}  // namespace foldpar
