// The pipeline bubble per schedule, measured: each rank is one stage of tsp=1 (pp = ranks),
//   mpirun -np 2 build/bench/pipeline_bubble_bench [--model configs/small.json] [--seq 256]
//       [--micro-batches 4] [--schedules 1f1b,interleaved:2,zb] [--reps 5]
// For each schedule at the same m (micro-batches of one sequence), repetitions interleaved:
// every rank starts the step after a barrier and ends it at a barrier, so the step takes the
// same wall time T on every rank; a rank's idle time is T less what it spent computing (its
// time inside the step less its waits on the boundary, StepResult::exposed_comm_seconds),
// that is the time it waited for its neighbours, the drain included. Reports medians: the
// step, each stage's idle fraction and their mean, against the equal-stage bubble of the
// schedule with unit-time ops (pipeline_schedule.h: 1F1B (p-1)/(m+p-1), interleaved
// (p-1)/(m v+p-1), ZB-H1 (p-1)/(3m+p-1)) and 1F1B's. Figures only: it asserts nothing
// (docs/PERFORMANCE.md records runs).
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "app/synthetic.h"
#include "backend/backend.h"
#include "bench_cli.h"
#include "comm/mesh.h"
#include "comm/mpi_runtime.h"
#include "core/timing.h"
#include "parallel/make_layout.h"

using namespace foldpar;

namespace {

// One schedule's model and its measured repetitions.
struct Run {
  Layout layout;
  std::unique_ptr<ShardedModel> model;
  std::vector<double> step;               // T, seconds
  std::vector<std::vector<double>> idle;  // per rep: each stage's idle fraction
};

// The equal-stage bubble of the layout's schedule with unit-time F, B (and W) ops.
double equal_stage_bubble(const Layout& l, int m) {
  const double p = l.pp;
  if (l.zero_bubble) return (p - 1) / (3.0 * m + p - 1);
  return (p - 1) / (static_cast<double>(m) * l.chunks + p - 1);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path = "configs/small.json";
  std::vector<std::string> schedules = {"1f1b", "interleaved:2", "zb"};
  int64_t seq = 256;
  int m = 4, reps = 5;
  CLI::App app{"The pipeline bubble per schedule on tsp=1 stages, measured (run under mpirun)",
               "pipeline_bubble_bench"};
  app.add_option("--model", model_path, "model config (JSON)");
  app.add_option("--seq", seq, "tokens per sequence (S)")->check(bench::kPositive);
  app.add_option("--micro-batches", m, "micro-batches per step (m), one sequence each")->check(bench::kPositive);
  app.add_option("--schedules", schedules, "pipeline schedules as train --schedule spells them, comma-separated")
      ->delimiter(',');
  app.add_option("--reps", reps, "interleaved repetitions (medians)")->check(bench::kPositive);
  Result<CommOptions> comm_options = CommOptions::from_env();
  MpiRuntime mpi(&argc, &argv, comm_options.ok() ? comm_options.value() : CommOptions());
  Communicator& world = mpi.world();
  const int P = world.size(), rank = world.rank();
  if (std::optional<int> rc = bench::parse_flags(app, argc, argv, rank == 0)) return *rc;
  auto fail = [&](const Status& s) {
    if (rank == 0) std::fprintf(stderr, "pipeline_bubble_bench: %s\n", s.to_string().c_str());
    return 2;
  };
  if (P < 2) return fail(invalid_argument("run on at least 2 ranks (one stage each), got {}", P));
  set_cpu_backend_threads(1);
  Result<LlamaConfig> config = LlamaConfig::load(model_path);
  if (!config.ok()) return fail(config.status());
  const LlamaConfig& c = config.value();
  auto be = make_cpu_backend();
  Layout base;
  base.pp = P;
  Result<Mesh> mesh = Mesh::create(world, base.mesh());
  if (!mesh.ok()) return fail(mesh.status());

  std::vector<Run> runs;
  for (const std::string& text : schedules) {
    Result<PipelineSchedule> schedule = parse_schedule(text);
    if (!schedule.ok()) return fail(schedule.status());
    Run run;
    run.layout = base;
    run.layout.chunks = schedule->chunks;
    run.layout.zero_bubble = schedule->zero_bubble;
    if (Status st = validate_micro_batches(run.layout, m); !st.ok()) return fail(st);
    Result<std::unique_ptr<ShardedModel>> model = make_sharded_model(c, *mesh, seq, run.layout);
    if (!model.ok()) return fail(model.status());
    run.model = std::move(*model);
    run.model->init_weights(InitOptions{.seed = 1});
    runs.push_back(std::move(run));
  }
  const Batch global = synthetic_batch(c, m, seq, 1);
  for (int rep = 0; rep < reps; ++rep)
    for (Run& run : runs) {
      std::vector<Batch> locals;
      for (int i = 0; i < m; ++i)
        locals.push_back(run.model->local_batch(
            Batch{global.input_ids.narrow(i, i + 1), global.target_ids.narrow(i, i + 1)}));
      run.model->zero_grads(*be);
      FP_CHECK_OK(world.barrier());
      const double t0 = now_seconds();
      Result<StepResult> r = run.model->forward_backward_micro_batches(*be, locals, 0);
      FP_CHECK_OK(r.status());
      const double inside = now_seconds() - t0;
      FP_CHECK_OK(world.barrier());
      const double step = now_seconds() - t0;
      double idle = (step - (inside - r->exposed_comm_seconds)) / step;  // this stage's
      std::vector<double> all(static_cast<size_t>(P));
      FP_CHECK_OK(world.all_gather(&idle, all.data(), 1, DType::kF64));
      run.step.push_back(step);
      run.idle.push_back(std::move(all));
    }
  if (rank != 0) return 0;
  std::printf("pp=%d,tsp=1, m=%d micro-batches of 1 x %lld tokens, %s, medians of %d\n", P, m,
              static_cast<long long>(seq), model_path.c_str(), reps);
  std::printf("%-16s %10s", "schedule", "step s");
  for (int s = 0; s < P; ++s) std::printf(" %9s%-2d", "idle st", s);
  std::printf(" %10s %12s %12s\n", "mean idle", "equal-stage", "1F1B (p-1)/(m+p-1)");
  for (const Run& run : runs) {
    std::printf("%-16s %10.4f", schedule_name(run.layout).c_str(), median(run.step));
    double mean = 0;
    for (int s = 0; s < P; ++s) {
      std::vector<double> of_stage;
      for (const std::vector<double>& rep : run.idle) of_stage.push_back(rep[static_cast<size_t>(s)]);
      mean += median(of_stage) / P;
      std::printf(" %10.1f%%", 100 * median(of_stage));
    }
    std::printf(" %9.1f%% %11.1f%% %11.1f%%\n", 100 * mean, 100 * equal_stage_bubble(run.layout, m),
                100.0 * (P - 1) / (m + P - 1));
  }
  return 0;
}
