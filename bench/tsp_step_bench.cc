// TSP training step against one rank, side by side in one run:
//   mpirun -np 2 build/bench/tsp_step_bench [--model configs/small.json] [--seq 4096,16384]
//                                           [--reps 3] [--batch 1]
// For each S, repetitions interleave: (a) the single-rank step on rank 0 while the others
// wait, (b) the tsp=D step with overlap, (c) the tsp=D step without overlap. Reports medians:
// tokens/s of one rank alone, tokens/s per rank under TSP and their ratio, the exposed
// communication time with and without overlap (how much of the transfer time overlap hid),
// and the tracked peak memory per rank.
#include <cstdio>
#include <string>
#include <vector>

#include "app/synthetic.h"
#include "backend/backend.h"
#include "bench_cli.h"
#include "comm/mpi_runtime.h"
#include "core/heap_policy.h"
#include "core/timing.h"
#include "parallel/tsp/tsp_model.h"

using namespace foldpar;

namespace {

struct TspRun {
  std::vector<double> seconds, exposed;
  int64_t peak = 0;
};

}  // namespace

int main(int argc, char** argv) {
  foldpar::keep_freed_heap_memory();  // as the foldpar program (core/heap_policy.h)
  std::string model_path = "configs/small.json";
  std::vector<int64_t> seqs = {4096, 16384};
  int reps = 3;
  int64_t batch = 1;
  CLI::App app{"The TSP training step against one rank, side by side (run under mpirun)", "tsp_step_bench"};
  app.add_option("--model", model_path, "model config (JSON)");
  app.add_option("--seq", seqs, "sequence lengths S, comma-separated")->delimiter(',')->check(bench::kPositive);
  app.add_option("--reps", reps, "interleaved repetitions (medians)")->check(bench::kPositive);
  app.add_option("--batch", batch, "sequences per step (B)")->check(bench::kPositive);
  Result<CommOptions> comm_options = CommOptions::from_env();
  MpiRuntime mpi(&argc, &argv, comm_options.ok() ? comm_options.value() : CommOptions());
  Communicator& world = mpi.world();
  const int D = world.size(), p = world.rank();
  if (std::optional<int> rc = bench::parse_flags(app, argc, argv, p == 0)) return *rc;
  set_cpu_backend_threads(1);
  Result<LlamaConfig> config = LlamaConfig::load(model_path);
  if (!config.ok()) {
    if (p == 0) std::fprintf(stderr, "tsp_step_bench: %s\n", config.status().to_string().c_str());
    return 2;
  }
  const LlamaConfig& c = config.value();
  auto be = make_cpu_backend();
  MemoryTracker& mt = MemoryTracker::process();
  if (p == 0)
    std::printf("%-6s %-3s %11s %11s %11s %7s %12s %12s %7s %11s %11s\n", "seq", "D", "1-rank tok/s",
                "tsp tok/s/rk", "no-ovl t/s/r", "ratio", "exposed s", "exposed noov", "hidden", "1-rank MiB",
                "tsp MiB/rk");
  for (int64_t S : seqs) {
    const Batch global = synthetic_batch(c, batch, S, 1);
    std::vector<double> single;
    int64_t single_peak = 0;
    TspRun on, off;
    for (int rep = 0; rep < reps; ++rep) {
      // (a) one rank alone.
      FP_CHECK_OK(world.barrier());
      if (p == 0) {
        const int64_t base = mt.stats().current_total;
        mt.reset_peaks();
        LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
        init_weights(InitOptions{.seed = 1}, w);
        LlamaWeights g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
        g.zero();
        const double t0 = now_seconds();
        FP_CHECK_OK(model_forward_backward(c, *be, w, global, {}, g).status());
        single.push_back(now_seconds() - t0);
        single_peak = mt.stats().peak_total - base;
      }
      mt.release_cache();
      // (b), (c) TSP with and without overlap.
      for (bool overlap : {true, false}) {
        Layout opt = tsp_layout(D);
        opt.overlap = overlap;
        Result<TspModel> m = TspModel::create(c, opt, p, S);
        if (!m.ok()) {
          if (p == 0) std::fprintf(stderr, "tsp_step_bench: %s\n", m.status().to_string().c_str());
          return 2;
        }
        const Batch local = m->shard().local_batch(global);
        const int64_t base = mt.stats().current_total;
        mt.reset_peaks();
        ShardedWeights w = ShardedWeights::allocate(c, m->dims(), p, DType::kF32, MemCategory::kParameters);
        init_sharded_weights(InitOptions{.seed = 1}, w);
        ShardedWeights g = ShardedWeights::allocate(c, m->dims(), p, DType::kF32, MemCategory::kGradients);
        g.zero();
        FP_CHECK_OK(world.barrier());
        const double t0 = now_seconds();
        Result<StepResult> r = m->forward_backward(*be, world, w, local, g);
        FP_CHECK_OK(r.status());
        TspRun& run = overlap ? on : off;
        run.seconds.push_back(now_seconds() - t0);
        run.exposed.push_back(r->exposed_comm_seconds);
        run.peak = mt.stats().peak_total - base;
        mt.release_cache();
      }
    }
    // Rank 0 reports its own times; the slowest rank would show in its exposed time.
    if (p == 0) {
      const double tokens = static_cast<double>(batch * S);
      const double single_tps = tokens / median(single);
      const double tsp_tps = tokens / median(on.seconds) / D, off_tps = tokens / median(off.seconds) / D;
      const double exp_on = median(on.exposed), exp_off = median(off.exposed);
      std::printf("%-6lld %-3d %11.1f %11.1f %11.1f %6.0f%% %12.3f %12.3f %6.0f%% %11.1f %11.1f\n",
                  static_cast<long long>(S), D, single_tps, tsp_tps, off_tps, 100.0 * tsp_tps / single_tps, exp_on,
                  exp_off, exp_off > 0 ? 100.0 * (1.0 - exp_on / exp_off) : 0.0, single_peak / 1048576.0,
                  on.peak / 1048576.0);
      std::fflush(stdout);
    }
  }
  return 0;
}
