// `foldpar bench`: single-rank training steps (forward + backward), timed. The old spellings
// `bench --layouts` and `bench --calibrate` still run bench-layouts and calibrate, after a
// line naming the new command.
#include <cstdio>
#include <memory>

#include "app/step_bench.h"
#include "backend/machine_rates.h"
#include "cmd_bench_layouts.h"
#include "commands.h"
#include "job.h"

namespace foldpar::cli {
namespace {

struct BenchArgs {
  std::string model, device = "cpu";
  std::vector<int64_t> seqs{1024};
  StepBenchOptions options;  // config, seq and backend filled at run time
  int threads = 1;
  // The old spellings of bench-layouts and calibrate.
  std::vector<std::string> layouts;
  std::string out, hardware;
  bool calibrate = false, memory_only = false, forward = false;
};

void print_profile(const StepBenchReport& r) {
  double total = 0;
  for (const auto& [op, t] : r.op_times) total += t.seconds;
  const double steps = static_cast<double>(r.step_seconds.size());
  for (const auto& [op, t] : r.op_times)
    std::printf("    %-24s %8.1f ms/step %6.1f%% %6lld calls/step\n", op.c_str(), 1e3 * t.seconds / steps,
                100.0 * t.seconds / total, static_cast<long long>(t.calls / static_cast<int64_t>(steps)));
  std::printf("    %-24s %8.1f ms/step (median step %.1f ms)\n", "all ops", 1e3 * total / steps, 1e3 * r.median_seconds);
}

int run_step_bench_command(const BenchArgs& a) {
  if (a.model.empty()) return fail(invalid_argument("bench: --model is required"));
  Result<LlamaConfig> config = LlamaConfig::load(a.model);
  if (!config.ok()) return fail(config.status());
  Result<DeviceKind> kind = parse_device(a.device);
  if (!kind.ok()) return fail(kind.status());
  Result<Device> device = open_device(*kind, 0);
  if (!device.ok()) return fail(device.status());
  set_cpu_backend_threads(a.threads);
  // On the CPU: which GEMM engine the steps run on, and the yardsticks the step's rate is
  // divided by: the best GEMM this core runs (the faster engine, measured now) and its ISA peak.
  const bool cpu = device->backend == nullptr;
  GemmYardstick gemm;
  IsaPeak peak;
  if (cpu) {
    std::printf("%s\n", cpu_gemm_engine_summary().c_str());
    if (const std::string w = cpu_gemm_engine_warning(); !w.empty()) std::fprintf(stderr, "warning: %s\n", w.c_str());
    gemm = measure_gemm_yardstick(1024, 5);  // 1024^3: within a few % of 2048^3, a fifth of the time
    peak = measure_isa_peak();
    std::printf("best gemm %dx%dx%d f32 %.1f GFLOP/s (%s; openblas %.1f, onednn %.1f)\n%s\n", gemm.n, gemm.n, gemm.n,
                gemm.best_gflops, gemm.best_engine.c_str(), gemm.openblas_gflops, gemm.onednn_gflops, peak.how.c_str());
    std::printf("%-8s %-6s %12s %12s %10s %14s %10s %10s\n", "seq", "batch", "step s", "tokens/s", "GFLOP/s", "peak MiB",
                "of gemm", "of peak");
  } else {
    std::printf("%-8s %-6s %12s %12s %10s %14s\n", "seq", "batch", "step s", "tokens/s", "GFLOP/s", "peak MiB");
  }
  for (int64_t seq : a.seqs) {
    StepBenchOptions o = a.options;
    o.config = config.value();
    o.seq = seq;
    o.backend = device->backend.get();
    Result<StepBenchReport> r = run_step_bench(o);
    if (!r.ok()) return fail(r.status());
    std::printf("%-8lld %-6lld %12.3f %12.1f %10.1f %14.1f", static_cast<long long>(seq),
                static_cast<long long>(o.batch), r->median_seconds, r->tokens_per_second, r->gflops,
                static_cast<double>(r->memory.peak_total) / (1 << 20));
    // A bf16 step is held against the f32 yardsticks too (the bf16 peak is on the line above).
    if (cpu) std::printf(" %9.1f%% %9.1f%%", 100 * r->gflops / gemm.best_gflops, 100 * r->gflops / peak.f32_gflops);
    std::printf("\n");
    if (o.profile) print_profile(*r);
    std::fflush(stdout);
  }
  return kExitOk;
}

// `bench --layouts` and `bench --calibrate`: what they were, with a line naming the new command.
int run_old_spelling(const BenchArgs& a) {
  if (a.device != "cpu")
    return fail(invalid_argument("bench --layouts and --calibrate run on the CPU only, not --device {}", a.device));
  if (a.calibrate && !a.layouts.empty()) return fail(invalid_argument("give --calibrate or --layouts, not both"));
  if (is_first_rank())
    std::fprintf(stderr, "foldpar: note: `bench %s` is now `foldpar %s`\n", a.calibrate ? "--calibrate" : "--layouts",
                 a.calibrate ? "calibrate" : "bench-layouts");
  if (a.calibrate) return run_calibrate(a.out);
  BenchLayoutsArgs b;
  b.model = a.model;
  b.layouts = a.layouts;
  b.out = a.out;
  b.hardware = a.hardware;
  b.seqs = a.seqs;
  b.batch = a.options.batch;
  b.steps = a.options.steps;
  b.recompute = a.options.recompute;
  b.memory_only = a.memory_only;
  b.forward = a.forward;
  return run_bench_layouts(b);
}

}  // namespace

Command add_bench_command(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  StepBenchOptions& o = a->options;
  CLI::App* cmd = app.add_subcommand("bench", "time single-rank training steps (forward + backward)");
  cmd->add_option("--model", a->model, "Hugging Face style config.json (required)")->check(CLI::ExistingFile);
  cmd->add_option("--batch", o.batch, "sequences per batch (B)")->check(positive());
  cmd->add_option("--seq", a->seqs, "tokens per sequence (S); repeat or comma-separate for several")
      ->delimiter(',')
      ->check(positive());
  cmd->add_option("--steps", o.steps, "timed steps (median reported)");
  cmd->add_option("--warmup", o.warmup, "untimed steps first")->check(non_negative());
  cmd->add_option("--threads", a->threads, "BLAS threads")->check(positive());
  add_recompute_option(cmd, o.recompute);
  cmd->add_flag("--profile", o.profile, "print the time spent in each backend op");
  cmd->add_flag("--bf16", o.bf16, "bf16 weights and activations, as train --bf16 on one rank");
  add_device_option(cmd, a->device, "GPU 0; built with -DFOLDPAR_WITH_CUDA=ON");
  const std::string old = "Old spellings, kept for now";
  cmd->add_option("--layouts", a->layouts, "now `foldpar bench-layouts --layouts`")->group(old);
  cmd->add_flag("--calibrate", a->calibrate, "now `foldpar calibrate`")->group(old);
  cmd->add_option("--out", a->out, "with --layouts or --calibrate: their --out")->group(old);
  cmd->add_option("--hardware", a->hardware, "with --layouts: its --hardware")->group(old);
  cmd->add_flag("--memory-only", a->memory_only, "with --layouts: its --memory-only")->group(old);
  cmd->add_flag("--forward", a->forward, "with --layouts: its --forward")->group(old);
  return {cmd, [a] { return a->calibrate || !a->layouts.empty() ? run_old_spelling(*a) : run_step_bench_command(*a); }};
}

}  // namespace foldpar::cli
