// Single-rank training step (forward + backward) of a config at several sequence lengths,
// one thread, beside the sgemm rate measured in the same run.
// Usage: train_step_bench [--model configs/small.json] [--seq 1024,4096] [--steps 3]
//                         [--recompute none|block] [--json]
#include <cstdio>
#include <string>
#include <vector>

#include "app/step_bench.h"
#include "backend/backend.h"
#include "bench_cli.h"
#include "core/heap_policy.h"
#include "sgemm_rate.h"

using namespace foldpar;

int main(int argc, char** argv) {
  foldpar::keep_freed_heap_memory();  // as the foldpar program (core/heap_policy.h)
  std::string model = "configs/small.json";
  std::vector<int64_t> seqs = {1024, 4096};
  int steps = 3;
  bool json = false;
  CLI::App app{"Single-rank training step of a config at several sequence lengths, one thread", "train_step_bench"};
  app.add_option("--model", model, "model config (JSON)");
  app.add_option("--seq", seqs, "sequence lengths S, comma-separated")->delimiter(',')->check(bench::kPositive);
  app.add_option("--steps", steps, "timed steps per S (median)")->check(bench::kPositive);
  std::string recompute = "none";
  app.add_option("--recompute", recompute, "activation recomputation: none|block")
      ->check(CLI::IsMember({"none", "block"}));
  app.add_flag("--json", json, "one JSON object per S instead of the table");
  if (std::optional<int> code = bench::parse_flags(app, argc, argv)) return *code;
  const Recompute rc = recompute == "block" ? Recompute::kBlock : Recompute::kNone;
  set_cpu_backend_threads(1);
  Result<LlamaConfig> config = LlamaConfig::load(model);
  if (!config.ok()) {
    std::fprintf(stderr, "train_step_bench: %s\n", config.status().to_string().c_str());
    return 2;
  }
  const double sgemm = bench::sgemm_gflops();
  if (!json) {
    std::printf("sgemm 2048^3, 1 thread: %.1f GFLOP/s\n", sgemm);
    std::printf("%-7s %10s %10s %10s %9s %12s %12s\n", "seq", "step s", "tokens/s", "GFLOP/s", "of sgemm",
                "tracked MiB", "RSS MiB");
  }
  for (int64_t seq : seqs) {
    StepBenchOptions o;
    o.config = config.value();
    o.seq = seq;
    o.steps = steps;
    o.recompute = rc;
    Result<StepBenchReport> r = run_step_bench(o);
    if (!r.ok()) {
      std::fprintf(stderr, "train_step_bench: %s\n", r.status().to_string().c_str());
      return 2;
    }
    const double sgemm_after = bench::sgemm_gflops(2048, 3);  // bracket the step: noise shows as a gap
    const double rate = 0.5 * (sgemm + sgemm_after);
    if (json) {
      std::printf(
          "{\"seq\": %lld, \"step_s_median\": %.4f, \"tokens_per_s\": %.1f, \"gflops\": %.2f, \"sgemm_gflops\": %.2f, "
          "\"fraction_of_sgemm\": %.3f, \"tracked_peak_bytes\": %lld, \"peak_rss_bytes\": %lld}\n",
          static_cast<long long>(seq), r->median_seconds, r->tokens_per_second, r->gflops, rate, r->gflops / rate,
          static_cast<long long>(r->memory.peak_total), static_cast<long long>(r->peak_rss_bytes));
    } else {
      std::printf("%-7lld %10.3f %10.1f %10.1f %8.0f%% %12.1f %12.1f\n", static_cast<long long>(seq),
                  r->median_seconds, r->tokens_per_second, r->gflops, 100.0 * r->gflops / rate,
                  static_cast<double>(r->memory.peak_total) / (1 << 20),
                  static_cast<double>(r->peak_rss_bytes) / (1 << 20));
    }
    std::fflush(stdout);
  }
  return 0;
}
