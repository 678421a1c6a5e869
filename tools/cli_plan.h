// `foldpar plan`: its flags, its output and its run. Included by main.cc only, so that CLI11
// stays in one translation unit. What the plan computes lives in src/plan/; here: flags in,
// a table (or --json) out. No MPI: it runs as one process.
//
//   foldpar plan --model configs/paper-7b.json --seq 131072 --batch 1 --devices 8
//       --hardware hardware/mi300x-8.json [--train|--forward|--prefill|--decode] [--bf16]
//       [--recompute block] [--layouts tsp=8,tp=8] [--max-new-tokens N] [--json]
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "cli_layout.h"
#include "core/status.h"
#include "plan/planner.h"

namespace foldpar::cli {

struct PlanArgs {
  std::string model, hardware;
  std::vector<std::string> layouts;
  Recompute recompute = Recompute::kNone;
  int64_t seq = 0, batch = 1, max_new_tokens = 0;
  int devices = 0;
  bool train = false, forward = false, prefill = false, decode = false, bf16 = false, json = false;
};

inline CLI::App* add_plan(CLI::App& app, PlanArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "plan", "predict memory, traffic and step time per rank for every layout, and recommend one (no MPI)");
  cmd->add_option("--model", a.model, "Hugging Face style config.json")->required();
  cmd->add_option("--seq", a.seq, "tokens per sequence (S); decode: tokens already cached")->required();
  cmd->add_option("--batch", a.batch, "sequences per step (B, global; split over dp)");
  cmd->add_option("--devices", a.devices, "ranks of the job (N)")->required();
  cmd->add_option("--hardware", a.hardware, "hardware description JSON (hardware/*.json)")->required();
  cmd->add_flag("--train", a.train, "one training step: forward + backward (the default)");
  cmd->add_flag("--forward", a.forward, "one forward with the loss (evaluation)");
  cmd->add_flag("--prefill", a.prefill, "generation's prefill (tsp and tp)");
  cmd->add_flag("--decode", a.decode, "one decode step of B tokens (tsp and tp)");
  cmd->add_option("--max-new-tokens", a.max_new_tokens, "prefill, decode: the KV cache holds S + this many tokens");
  cmd->add_flag("--bf16", a.bf16, "bf16 storage of weights and activations (f32 gradients, statistics, masters)");
  add_recompute_flag(cmd, a.recompute);
  cmd->add_option("--layouts", a.layouts, "only these layouts, space-separated: tsp=8 tp=4,sp=2:seqpar sp=8:ring (',' joins axes, ':' adds options)");
  cmd->add_flag("--json", a.json, "print the plan as JSON");
  return cmd;
}

inline Result<PlanRequest> plan_request(const PlanArgs& a) {
  PlanRequest r;
  FP_ASSIGN_OR_RETURN(r.config, LlamaConfig::load(a.model));
  FP_ASSIGN_OR_RETURN(r.hardware, Hardware::load(a.hardware));
  r.model_name = a.model;
  r.devices = a.devices;
  r.batch = a.batch;
  r.seq = a.seq;
  r.max_new_tokens = a.max_new_tokens;
  r.bf16 = a.bf16;
  if (a.max_new_tokens < 0) return invalid_argument("--max-new-tokens ({}) must not be negative", a.max_new_tokens);
  const int modes = int{a.train} + int{a.forward} + int{a.prefill} + int{a.decode};
  if (modes > 1) return invalid_argument("give one of --train, --forward, --prefill, --decode, not {}", modes);
  r.mode = a.forward ? PlanMode::kForward : a.prefill ? PlanMode::kPrefill : a.decode ? PlanMode::kDecode : PlanMode::kTrain;
  r.recompute = a.recompute;
  if (!a.layouts.empty()) {
    FP_ASSIGN_OR_RETURN(r.layouts, layouts_of(a.layouts));
    for (Layout& l : r.layouts) {
      if (a.bf16) l.dtype = DType::kBF16;
      if (r.recompute == Recompute::kBlock) l.recompute = Recompute::kBlock;
    }
  }
  return r;
}

inline int run_plan(const PlanArgs& a, int (*fail)(const Status&)) {
  Result<PlanRequest> r = plan_request(a);
  if (!r.ok()) return fail(r.status());
  Result<PlanReport> report = make_plan(*r);
  if (!report.ok()) return fail(report.status());
  std::fputs((a.json ? plan_report_json(*report) : plan_report_text(*report)).c_str(), stdout);
  return 0;
}

}  // namespace foldpar::cli
