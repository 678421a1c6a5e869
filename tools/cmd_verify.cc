// `foldpar verify`: the fast path's loss, logits and gradients against the reference, on one
// rank or under a layout (mpirun). Exit 1 when an error is above the tolerance.
#include <cstdio>
#include <memory>

#include "app/verify.h"
#include "cli_layout.h"
#include "commands.h"
#include "job.h"

namespace foldpar::cli {
namespace {

struct VerifyArgs {
  std::string model;
  VerifyOptions options;  // config, recompute and layout filled from the flags below
  bool json = false;
  LayoutArgs layout;
};

int run_verify_command(VerifyArgs& a) {
  VerifyOptions o = a.options;
  Result<LlamaConfig> config = LlamaConfig::load(a.model);
  if (!config.ok()) return fail(config.status());
  Result<Layout> layout = layout_of(a.layout, 1);
  if (!layout.ok()) return fail(layout.status());
  o.config = config.value();
  o.recompute = layout->recompute;
  if (!a.layout.layout.empty()) o.layout = layout.value();
  Result<VerifyReport> report = Status();
  Result<Job> job = Status();
  if (a.layout.layout.empty()) {
    report = run_verify(o);
  } else {
    job = start_job();
    if (!job.ok()) return fail(job.status());
    report = run_verify_layout(o, job->world());
  }
  if (!report.ok()) return fail(report.status());
  if (is_first_rank()) std::fputs((a.json ? verify_report_json(*report) : verify_report_text(*report)).c_str(), stdout);
  return report->passed ? kExitOk : kExitCheckFailed;
}

}  // namespace

Command add_verify_command(CLI::App& app) {
  auto a = std::make_shared<VerifyArgs>();
  VerifyOptions& o = a->options;
  CLI::App* cmd = app.add_subcommand("verify", "compare the fast path's loss, logits and gradients with the reference");
  cmd->add_option("--model", a->model, "Hugging Face style config.json")->required()->check(CLI::ExistingFile);
  cmd->add_option("--seed", o.seed, "seed of the weights and tokens");
  cmd->add_option("--batch", o.batch, "sequences per batch (B)")->check(positive());
  cmd->add_option("--seq", o.seq, "tokens per sequence (S)")->check(positive());
  cmd->add_option("--tolerance", o.tolerance, "largest relative error accepted (default: the f32 model tolerance)")
      ->check(non_negative());
  cmd->add_option("--dump", o.dump_dir, "write config, weights, batch, gradients and result to this directory");
  cmd->add_flag("--json", a->json, "print the report as JSON");
  add_layout_flags(cmd, a->layout);
  return {cmd, [a] { return run_verify_command(*a); }};
}

}  // namespace foldpar::cli
