// `foldpar plan`: predicted memory, traffic and step time per rank for every layout, and a
// recommendation (src/plan/). No MPI: it runs as one process.
//
//   foldpar plan --model configs/paper-7b.json --seq 131072 --batch 1 --devices 8
//       --hardware hardware/mi300x-8.json [--train|--forward|--prefill|--decode] [--bf16]
//       [--recompute block] [--moe-imbalance X] [--layouts tsp=8 tp=8] [--micro-batch M] [--choose-schedule] [--max-new-tokens N] [--json] [--trace F]
//       [--explain]
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "cli_layout.h"
#include "commands.h"
#include "plan/planner.h"

namespace foldpar::cli {
namespace {

struct PlanArgs {
  std::string model, hardware;
  std::vector<std::string> layouts;
  PlanRequest request;  // config, hardware, mode and layouts filled at run time
  bool train = false, forward = false, prefill = false, decode = false, json = false, explain = false;
  std::string trace;  // Chrome trace of the recommended layout's simulated step
};

Result<PlanRequest> plan_request(const PlanArgs& a) {
  PlanRequest r = a.request;
  FP_ASSIGN_OR_RETURN(r.config, LlamaConfig::load(a.model));
  FP_ASSIGN_OR_RETURN(r.hardware, Hardware::load(a.hardware));
  r.model_name = a.model;
  const int modes = int{a.train} + int{a.forward} + int{a.prefill} + int{a.decode};
  if (modes > 1) return invalid_argument("give one of --train, --forward, --prefill, --decode, not {}", modes);
  r.mode = a.forward ? PlanMode::kForward : a.prefill ? PlanMode::kPrefill : a.decode ? PlanMode::kDecode : PlanMode::kTrain;
  if (!a.layouts.empty()) {
    FP_ASSIGN_OR_RETURN(r.layouts, layout_list(a.layouts, r.recompute, r.bf16));
  }
  return r;
}

int run_plan_command(const PlanArgs& a) {
  Result<PlanRequest> r = plan_request(a);
  if (!r.ok()) return fail(r.status());
  Result<PlanReport> report = make_plan(*r);
  if (!report.ok()) return fail(report.status());
  std::fputs((a.json ? plan_report_json(*report) : plan_report_text(*report)).c_str(), stdout);
  if (a.explain || !a.trace.empty()) {
    if (report->recommended < 0) return fail(invalid_argument("no layout fits: nothing to explain or trace"));
    const LayoutPlan& p = report->layouts[static_cast<size_t>(report->recommended)];
    if (a.explain) std::fprintf(stdout, "explain %s:\n%s", p.layout.to_string().c_str(), explain_timeline(p.timelines).c_str());
    if (!a.trace.empty()) {
      std::FILE* f = std::fopen(a.trace.c_str(), "w");
      if (f == nullptr) return fail(io_error("cannot write the trace {}: {}", a.trace, std::strerror(errno)));
      const std::string json = chrome_trace_json(p.timelines);
      const bool ok = std::fwrite(json.data(), 1, json.size(), f) == json.size();
      if (std::fclose(f) != 0 || !ok) return fail(io_error("cannot write the trace {}", a.trace));
    }
  }
  return kExitOk;
}

}  // namespace

Command add_plan_command(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  PlanRequest& r = a->request;
  CLI::App* cmd = app.add_subcommand(
      "plan", "predict memory, traffic and step time per rank for every layout, and recommend one (no MPI)");
  cmd->add_option("--model", a->model, "Hugging Face style config.json")->required()->check(CLI::ExistingFile);
  cmd->add_option("--seq", r.seq, "tokens per sequence (S); decode: tokens already cached")->required();
  cmd->add_option("--batch", r.batch, "sequences per step (B, global; split over dp)");
  cmd->add_option("--micro-batch", r.micro_batch,
                  "training: sequences per forward per data-parallel rank, as train's (default: all; a pipeline "
                  "tries each size that fills it)")
      ->check(positive());
  cmd->add_flag("--choose-schedule", r.choose_schedule,
                "training, pipelined --layouts naming no schedule: also plan interleaved:2 and zb beside 1f1b and "
                "recommend one (always done without --layouts)");
  cmd->add_option("--devices", r.devices, "ranks of the job (N)")->required();
  cmd->add_option("--hardware", a->hardware, "hardware description JSON (hardware/*.json)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_flag("--train", a->train, "one training step: forward + backward (the default)");
  cmd->add_flag("--forward", a->forward, "one forward with the loss (evaluation)");
  cmd->add_flag("--prefill", a->prefill, "generation's prefill (tsp and tp)");
  cmd->add_flag("--decode", a->decode, "one decode step of B tokens (tsp and tp)");
  cmd->add_option("--max-new-tokens", r.max_new_tokens, "prefill, decode: the KV cache holds S + this many tokens")
      ->check(non_negative());
  cmd->add_flag("--bf16", r.bf16, "bf16 storage of weights and activations (f32 gradients, statistics, masters)");
  add_recompute_option(cmd, r.recompute);
  cmd->add_option("--moe-imbalance", r.moe_imbalance,
                  "MoE models: the routing the plan assumes (it has no data): 1 balanced (default); X > 1 gives "
                  "expert 0 X times its balanced share on every rank")
      ->check(CLI::Range(1.0, 1e9));
  cmd->add_option("--layouts", a->layouts, "only these layouts, space-separated: tsp=8 tp=4,sp=2:seqpar sp=8:ring (',' joins axes, ':' adds options)");
  cmd->add_flag("--json", a->json, "print the plan as JSON");
  cmd->add_option("--trace", a->trace, "write the recommended layout's simulated step (every distinct rank) as a Chrome trace (open in Perfetto)");
  cmd->add_flag("--explain", a->explain, "say what bounds the recommended layout's step: compute, a named collective, memory");
  return {cmd, [a] { return run_plan_command(*a); }};
}

}  // namespace foldpar::cli
