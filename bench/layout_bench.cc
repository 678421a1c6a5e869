// Layouts side by side on the same kernels, in one run, measured beside the plan:
//   mpirun -np 2 build/bench/layout_bench --model configs/small.json --seq 4096,16384
//       --layouts "tsp=2;tp=2;sp=2;sp=2:ring" [--reps 3] [--memory-only]
//       [--hardware hardware/this-machine.json] [--out DIR]
// Every layout must use all the job's ranks (tp=2,sp=2 and tsp=4 under -np 4; ';' separates
// layouts). Options follow ':' ("sp=2:ring" ring attention, "tp=2:seqpar" Megatron's
// sequence parallelism, "tsp=2:bf16" bf16 storage; layout/layout.h lists them all). The work is src/app/layout_bench.h, which
// `foldpar bench --layouts` runs too: for each S, repetitions interleave the layouts (one
// training step each); the table gives medians of the step time (slowest rank), tokens/s,
// the exposed communication time (rank 0), the tracked peak per rank (worst rank) and the
// bytes rank 0 sent, each beside the plan's prediction. --memory-only runs one step per
// layout (for oversubscribed runs, where time means little).
#include <cstdio>
#include <string>
#include <vector>

#include "app/layout_bench.h"
#include "bench_cli.h"
#include "comm/mpi_runtime.h"
#include "core/heap_policy.h"

using namespace foldpar;

int main(int argc, char** argv) {
  foldpar::keep_freed_heap_memory();  // as the foldpar program (core/heap_policy.h)
  std::string model = "configs/small.json", layouts = "tsp=2;tp=2;sp=2;sp=2:ring";
  std::string hardware, out;
  LayoutBenchOptions o;
  o.seqs = {4096, 16384};
  CLI::App app{"Layouts side by side on the same kernels, beside the plan (run under mpirun)", "layout_bench"};
  app.add_option("--model", model, "model config (JSON)");
  app.add_option("--layouts", layouts, "the layouts to compare, each using every rank");
  app.add_option("--seq", o.seqs, "sequence lengths S, comma-separated")->delimiter(',')->check(bench::kPositive);
  app.add_option("--reps", o.reps, "interleaved repetitions (medians)")->check(bench::kPositive);
  app.add_flag("--memory-only", o.memory_only, "one step per layout (oversubscribed runs: time means little)");
  app.add_option("--hardware", hardware, "hardware JSON for the predicted step time");
  app.add_option("--out", out, "directory for table.csv, table.json and the plots");
  Result<CommOptions> comm_options = CommOptions::from_env();
  MpiRuntime mpi(&argc, &argv, comm_options.ok() ? comm_options.value() : CommOptions());
  Communicator& world = mpi.world();
  if (std::optional<int> rc = bench::parse_flags(app, argc, argv, world.rank() == 0)) return *rc;
  set_cpu_backend_threads(1);
  auto fail = [&](const Status& s) {
    if (world.rank() == 0) std::fprintf(stderr, "layout_bench: %s\n", s.to_string().c_str());
    return 2;
  };
  Hardware hw;
  Result<LlamaConfig> config = LlamaConfig::load(model);
  if (!config.ok()) return fail(config.status());
  o.config = *config;
  Result<std::vector<Layout>> specs = parse_layout_list({layouts});
  if (!specs.ok()) return fail(specs.status());
  o.layouts = *specs;
  if (!hardware.empty()) {
    Result<Hardware> h = Hardware::load(hardware);
    if (!h.ok()) return fail(h.status());
    hw = *h;
    o.hardware = &hw;
  }
  Result<std::vector<LayoutBenchRow>> rows = run_layout_bench(o, world);
  if (!rows.ok()) return fail(rows.status());
  if (world.rank() != 0) return 0;
  std::fputs(layout_bench_text(*rows).c_str(), stdout);
  if (!out.empty()) {
    Result<std::vector<std::string>> files = write_layout_bench(*rows, out);
    if (!files.ok()) return fail(files.status());
    for (const std::string& f : *files) std::printf("wrote %s\n", f.c_str());
  }
  return 0;
}
