// `foldpar bench-layouts`: layouts side by side under mpirun. What it measures lives in
// src/app/layout_bench.h; here: flags in, table and files out.
//
//   mpirun -np 2 foldpar bench-layouts --layouts tsp=2 tp=2 sp=2:ring --model configs/small.json
//       --seq 1024,4096 [--steps 3] [--hardware hardware/this-machine.json] [--out DIR]
#include "cmd_bench_layouts.h"

#include <cstdio>
#include <memory>

#include "app/layout_bench.h"
#include "cli_layout.h"
#include "commands.h"
#include "job.h"

namespace foldpar::cli {
namespace {

Result<LayoutBenchOptions> layout_bench_options(const BenchLayoutsArgs& a, Hardware& hw) {
  LayoutBenchOptions o;
  FP_ASSIGN_OR_RETURN(o.config, LlamaConfig::load(a.model));
  FP_ASSIGN_OR_RETURN(o.layouts, layout_list(a.layouts, a.recompute, false));
  o.seqs = a.seqs;
  o.batch = a.batch;
  o.micro_batch = a.micro_batch;
  o.reps = a.steps;
  o.memory_only = a.memory_only;
  o.forward_only = a.forward;
  o.warmup = a.warmup;
  o.profile = a.profile;
  if (!a.hardware.empty()) {
    FP_ASSIGN_OR_RETURN(hw, Hardware::load(a.hardware));
    o.hardware = &hw;
  }
  return o;
}

}  // namespace

int run_bench_layouts(const BenchLayoutsArgs& a) {
  if (a.model.empty()) return fail(invalid_argument("bench-layouts: --model is required"));
  Hardware hw;
  Result<LayoutBenchOptions> o = layout_bench_options(a, hw);
  if (!o.ok()) return fail(o.status());
  Result<Job> job = start_job();
  if (!job.ok()) return fail(job.status());
  set_cpu_backend_threads(1);
  Result<std::vector<LayoutBenchRow>> rows = run_layout_bench(*o, job->world());
  if (!rows.ok()) return fail(rows.status());
  if (!job->root()) return kExitOk;
  std::fputs(layout_bench_text(*rows).c_str(), stdout);
  std::fputs(layout_bench_profile_text(*rows).c_str(), stdout);
  if (!a.out.empty()) {
    Result<std::vector<std::string>> files = write_layout_bench(*rows, a.out);
    if (!files.ok()) return fail(files.status());
    for (const std::string& f : *files) std::printf("wrote %s\n", f.c_str());
  }
  return kExitOk;
}

Command add_bench_layouts_command(CLI::App& app) {
  auto a = std::make_shared<BenchLayoutsArgs>();
  CLI::App* cmd = app.add_subcommand("bench-layouts", "time layouts side by side on the CPU (run under mpirun)");
  cmd->add_option("--model", a->model, "Hugging Face style config.json")->required()->check(CLI::ExistingFile);
  cmd->add_option("--layouts", a->layouts,
                  "these layouts, each using every rank: tsp=2 tp=2 sp=2:ring tp=2,sp=2:seqpar (spaces separate "
                  "layouts, ',' joins axes, ':' adds ring, seqpar, contiguous, nooverlap, keepw, keepkv, buckets=N, "
                  "recompute, bf16, stages=A/B/.., interleaved=V, zb)")
      ->required();
  cmd->add_option("--seq", a->seqs, "tokens per sequence (S); repeat or comma-separate for several")
      ->delimiter(',')
      ->check(positive());
  cmd->add_option("--batch", a->batch, "sequences per batch (B)")->check(positive());
  cmd->add_option("--micro-batch", a->micro_batch,
                  "sequences per micro-batch of a pp layout's schedule (default 1: B micro-batches)")
      ->check(positive());
  cmd->add_option("--steps", a->steps, "interleaved repetitions (medians reported)")->check(positive());
  cmd->add_option("--warmup", a->warmup, "untimed steps of each layout's model before its timed step (0: time a cold step)")
      ->check(non_negative());
  cmd->add_flag("--profile", a->profile, "time each backend op on rank 0 beside the plan's price of it");
  add_recompute_option(cmd, a->recompute);
  cmd->add_option("--out", a->out, "directory for table.csv, table.json and PNGs");
  cmd->add_option("--hardware", a->hardware, "hardware JSON for the predicted step time");
  cmd->add_flag("--memory-only", a->memory_only, "one step per layout, peaks only (oversubscribed runs)");
  cmd->add_flag("--forward", a->forward, "forward steps (with the loss) instead of training steps");
  return {cmd, [a] { return run_bench_layouts(*a); }};
}

}  // namespace foldpar::cli
