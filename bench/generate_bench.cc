// Generation side by side: prefill and decode under tsp=D and tp=D on the same kernels.
//   mpirun -np 2 build/bench/generate_bench --model configs/small.json --seq 8192,32768
//       --batch 1,8 --prompt 1024 --new 64 --layouts tsp=2,tp=2 [--reps 1]
// Counter-based random weights (speed does not depend on their values). For each layout:
//   prefill  one prompt of S random tokens: seconds (slowest rank), tokens/s, the time rank 0
//            spent blocked on communication, KV cache and tracked peak per rank (worst rank);
//   decode   B prompts of --prompt tokens, then --new greedy steps: tokens/s = B x steps /
//            seconds (slowest rank), milliseconds per step, bytes each rank sent per step.
// Repetitions alternate the layouts; medians. Every layout uses all the job's ranks.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_cli.h"
#include "comm/comm_stats.h"
#include "comm/mesh.h"
#include "comm/mpi_runtime.h"
#include "core/rng.h"
#include "core/timing.h"
#include "parallel/make_layout.h"

using namespace foldpar;

namespace {

double max_over(Communicator& world, double x) {
  FP_CHECK_OK(world.all_reduce(&x, &x, 1, DType::kF64, ReduceOp::kMax));
  return x;
}

std::vector<std::vector<int32_t>> prompts(const LlamaConfig& c, int64_t batch, int64_t len) {
  std::vector<std::vector<int32_t>> p(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < len; ++i)
      p[static_cast<size_t>(b)].push_back(
          static_cast<int32_t>(uniform_at(3, static_cast<uint64_t>(b), static_cast<uint64_t>(i)) * c.vocab_size));
  return p;
}

struct Built {
  std::unique_ptr<Mesh> mesh;
  std::unique_ptr<ShardedDecoder> decoder;
};

Built build(Communicator& world, const LlamaConfig& c, const std::string& layout) {
  const Layout l = parse_layout(layout).value();
  Result<Mesh> mesh = Mesh::create(world, l.mesh());
  FP_CHECK_OK(mesh.status());
  Built b;
  b.mesh = std::make_unique<Mesh>(std::move(mesh).value());
  Result<std::unique_ptr<ShardedDecoder>> d = make_sharded_decoder(c, *b.mesh, l);
  FP_CHECK_OK(d.status());
  b.decoder = std::move(d).value();
  b.decoder->init_weights(InitOptions{.seed = 1});
  return b;
}

struct PrefillRow {
  std::vector<double> seconds, comm;
  int64_t cache = 0, peak = 0;
};

void prefill_once(Communicator& world, const LlamaConfig& c, const std::string& layout, int64_t S, PrefillRow& row) {
  MemoryTracker& mt = MemoryTracker::process();
  mt.release_cache();
  const int64_t base = mt.stats().current_total;
  mt.reset_peaks();
  Built m = build(world, c, layout);
  auto be = make_cpu_backend();
  const auto p = prompts(c, 1, S);
  FP_CHECK_OK(world.barrier());
  const double t0 = now_seconds();
  FP_CHECK_OK(m.decoder->prefill(*be, p, 0).status());  // prefill alone: S may be the longest context
  row.seconds.push_back(max_over(world, now_seconds() - t0));
  row.comm.push_back(m.decoder->times().prefill_comm_seconds);
  row.cache = static_cast<int64_t>(max_over(world, static_cast<double>(m.decoder->cache().bytes())));
  row.peak = static_cast<int64_t>(max_over(world, static_cast<double>(mt.stats().peak_total - base)));
}

struct DecodeRow {
  std::vector<double> seconds;
  uint64_t bytes_per_step = 0;
};

void decode_once(Communicator& world, const LlamaConfig& c, const std::string& layout, int64_t B, int64_t prompt,
                 int64_t steps, DecodeRow& row) {
  Built m = build(world, c, layout);
  auto be = make_cpu_backend();
  Result<Tensor> logits = m.decoder->prefill(*be, prompts(c, B, prompt), steps);
  FP_CHECK_OK(logits.status());
  std::vector<int32_t> tokens(static_cast<size_t>(B));
  FP_CHECK_OK(world.barrier());
  ScopedCommCounter counter(m.mesh->communicators());
  const double t0 = now_seconds();
  for (int64_t t = 0; t < steps; ++t) {
    const int64_t V = logits->dim(1);
    for (int64_t b = 0; b < B; ++b) {
      const float* r = logits->data<float>() + b * V;
      tokens[static_cast<size_t>(b)] = static_cast<int32_t>(std::max_element(r, r + V) - r);
    }
    logits = m.decoder->decode(*be, tokens);
    FP_CHECK_OK(logits.status());
  }
  row.seconds.push_back(max_over(world, now_seconds() - t0));
  row.bytes_per_step = counter.delta().total().bytes_sent / static_cast<uint64_t>(steps);
}

struct Args {
  std::string model = "configs/small.json";
  std::vector<std::string> layouts{"tsp=2", "tp=2"};
  std::vector<int64_t> seqs{8192, 32768}, batches{1, 8};
  int64_t prompt = 1024, steps = 64;
  int reps = 1;
};

void add_flags(CLI::App& app, Args& a) {
  app.add_option("--model", a.model, "model config (JSON)");
  app.add_option("--layouts", a.layouts, "generation layouts, comma-separated (each uses every rank)")->delimiter(',');
  app.add_option("--seq", a.seqs, "prefill prompt lengths S, comma-separated")->delimiter(',')->check(bench::kPositive);
  app.add_option("--batch", a.batches, "decode batch sizes B, comma-separated")->delimiter(',')->check(bench::kPositive);
  app.add_option("--prompt", a.prompt, "tokens per decode prompt")->check(bench::kPositive);
  app.add_option("--new", a.steps, "decode steps")->check(bench::kPositive);
  app.add_option("--reps", a.reps, "repetitions, alternating the layouts (medians)")->check(bench::kPositive);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Generation side by side: prefill and decode under several layouts (run under mpirun)", "generate_bench"};
  add_flags(app, a);
  Result<CommOptions> options = CommOptions::from_env();
  FP_CHECK_OK(options.status());
  MpiRuntime mpi(&argc, &argv, options.value());
  Communicator& world = mpi.world();
  if (std::optional<int> rc = bench::parse_flags(app, argc, argv, world.rank() == 0)) return *rc;
  Result<LlamaConfig> c = LlamaConfig::load(a.model);
  FP_CHECK_OK(c.status());
  const bool root = world.rank() == 0;
  if (root)
    std::printf("%s, %d ranks; prefill: B = 1; decode: %lld-token prompts, %lld steps\n\n", a.model.c_str(),
                world.size(), static_cast<long long>(a.prompt), static_cast<long long>(a.steps));
  if (root) std::printf("| S | layout | prefill s | tokens/s | blocked on comm s | KV cache MiB/rank | peak MiB/rank |\n|---:|---|---:|---:|---:|---:|---:|\n");
  for (int64_t S : a.seqs) {
    std::vector<PrefillRow> rows(a.layouts.size());
    for (int r = 0; r < a.reps; ++r)
      for (size_t i = 0; i < a.layouts.size(); ++i) prefill_once(world, *c, a.layouts[i], S, rows[i]);
    for (size_t i = 0; i < a.layouts.size() && root; ++i) {
      const double s = median(rows[i].seconds);
      std::printf("| %lld | %s | %.2f | %.1f | %.3f | %.1f | %.1f |\n", static_cast<long long>(S), a.layouts[i].c_str(), s,
                  static_cast<double>(S) / s, median(rows[i].comm), rows[i].cache / 1048576.0, rows[i].peak / 1048576.0);
    }
    std::fflush(stdout);
  }
  if (root) std::printf("\n| B | layout | decode tokens/s | ms per step | KiB sent per step per rank |\n|---:|---|---:|---:|---:|\n");
  for (int64_t B : a.batches) {
    std::vector<DecodeRow> rows(a.layouts.size());
    for (int r = 0; r < a.reps; ++r)
      for (size_t i = 0; i < a.layouts.size(); ++i) decode_once(world, *c, a.layouts[i], B, a.prompt, a.steps, rows[i]);
    for (size_t i = 0; i < a.layouts.size() && root; ++i) {
      const double s = median(rows[i].seconds);
      std::printf("| %lld | %s | %.1f | %.2f | %.1f |\n", static_cast<long long>(B), a.layouts[i].c_str(),
                  static_cast<double>(B * a.steps) / s, 1e3 * s / static_cast<double>(a.steps),
                  rows[i].bytes_per_step / 1024.0);
    }
    std::fflush(stdout);
  }
  return 0;
}
