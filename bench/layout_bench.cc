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
#include <sstream>
#include <string>
#include <vector>

#include "app/layout_bench.h"
#include "comm/mpi_runtime.h"

using namespace foldpar;

namespace {

Result<std::vector<int64_t>> parse_seqs(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) continue;
    try {
      out.push_back(std::stoll(item));
    } catch (const std::exception&) {
      return invalid_argument("--seq: '{}' is not a number", item);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "configs/small.json", layouts = "tsp=2;tp=2;sp=2;sp=2:ring", seqs = "4096,16384";
  std::string hardware, out;
  int reps = 3;
  bool memory_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--model") model = value();
    else if (a == "--layouts") layouts = value();
    else if (a == "--seq") seqs = value();
    else if (a == "--reps") reps = std::atoi(value().c_str());
    else if (a == "--memory-only") memory_only = true;
    else if (a == "--hardware") hardware = value();
    else if (a == "--out") out = value();
    else {
      std::fprintf(stderr, "layout_bench: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  Result<CommOptions> comm_options = CommOptions::from_env();
  MpiRuntime mpi(&argc, &argv, comm_options.ok() ? comm_options.value() : CommOptions());
  Communicator& world = mpi.world();
  set_cpu_backend_threads(1);
  auto fail = [&](const Status& s) {
    if (world.rank() == 0) std::fprintf(stderr, "layout_bench: %s\n", s.to_string().c_str());
    return 2;
  };
  LayoutBenchOptions o;
  Hardware hw;
  Result<LlamaConfig> config = LlamaConfig::load(model);
  if (!config.ok()) return fail(config.status());
  o.config = *config;
  Result<std::vector<Layout>> specs = parse_layout_list({layouts});
  if (!specs.ok()) return fail(specs.status());
  o.layouts = *specs;
  Result<std::vector<int64_t>> s = parse_seqs(seqs);
  if (!s.ok()) return fail(s.status());
  o.seqs = *s;
  o.reps = reps;
  o.memory_only = memory_only;
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
