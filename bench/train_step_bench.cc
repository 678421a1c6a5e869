// Single-rank training step (forward + backward) of a config at several sequence lengths,
// one thread, beside the sgemm rate measured in the same run.
// Usage: train_step_bench [--model configs/small.json] [--seq 1024,4096] [--steps 3]
//                         [--recompute none|block] [--json]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "app/step_bench.h"
#include "backend/backend.h"
#include "sgemm_rate.h"

using namespace foldpar;

int main(int argc, char** argv) {
  std::string model = "configs/small.json";
  std::vector<int64_t> seqs = {1024, 4096};
  int steps = 3;
  bool json = false;
  Recompute rc = Recompute::kNone;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "train_step_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") {
      model = next();
    } else if (a == "--seq") {
      seqs.clear();
      std::stringstream ss(next());
      for (std::string item; std::getline(ss, item, ',');) seqs.push_back(std::stoll(item));
    } else if (a == "--steps") {
      steps = std::stoi(next());
    } else if (a == "--recompute") {
      rc = next() == "block" ? Recompute::kBlock : Recompute::kNone;
    } else if (a == "--json") {
      json = true;
    } else {
      std::fprintf(stderr, "train_step_bench: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
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
