// Layouts side by side on the same kernels, in one run:
//   mpirun -np 2 build/bench/layout_bench --model configs/small.json --seq 4096,16384 \
//       --layouts tsp=2,tp=2,sp=2,sp=2:ring [--reps 3] [--memory-only]
// Every layout must use all the job's ranks (tp=2+sp=2 and tsp=4 under -np 4; a 2-D layout
// is written with '+' because ',' separates layouts). For each S,
// repetitions interleave the layouts (one training step each: forward + backward); the table
// gives medians of the step time (slowest rank), tokens/s of the job and per rank, the
// exposed communication time (rank 0) and the tracked peak memory per rank (worst rank).
// --memory-only runs one step per layout (for oversubscribed runs, where time means little).
// A layout written "sp=2:ring" uses ring attention; "tp=2:seqpar" Megatron's sequence
// parallelism; "tsp=2:bf16" bf16 storage of weights and activations.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "app/synthetic.h"
#include "backend/bf16_storage_backend.h"
#include "comm/mesh.h"
#include "comm/mpi_runtime.h"
#include "parallel/make_layout.h"

using namespace foldpar;

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Row {
  std::vector<double> step_s, exposed_s;
  int64_t peak = 0;
};

// One step of `spec` ("tp=2:seqpar"); returns seconds (slowest rank), exposed comm, peak.
void run_once(Communicator& world, const LlamaConfig& c, const std::string& spec, const Batch& global, int64_t S,
              Row& row) {
  const std::vector<std::string> parts = split(spec, ':');
  LayoutOptions lo;
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i] == "ring") lo.kv_exchange = LayoutOptions::KvExchange::kRing;
    if (parts[i] == "seqpar") lo.sequence_parallel = true;
    if (parts[i] == "nooverlap") lo.overlap = false;
    if (parts[i] == "bf16") lo.dtype = DType::kBF16;
  }
  Result<Mesh> mesh = Mesh::create(world, parts[0]);
  FP_CHECK_OK(mesh.status());
  MemoryTracker& mt = MemoryTracker::process();
  mt.release_cache();
  const int64_t base = mt.stats().current_total;
  mt.reset_peaks();
  double seconds = 0, exposed = 0;
  {
    Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(c, *mesh, S, lo);
    FP_CHECK_OK(m.status());
    (*m)->init_weights(InitOptions{.seed = 1});
    const Batch local = (*m)->local_batch(global);
    auto cpu = make_cpu_backend();
    std::unique_ptr<Backend> bf16 = lo.dtype == DType::kBF16 ? make_bf16_storage_backend(*cpu) : nullptr;
    Backend* be = bf16 ? bf16.get() : cpu.get();
    FP_CHECK_OK(world.barrier());
    const auto t0 = std::chrono::steady_clock::now();
    Result<StepResult> r = (*m)->forward_backward(*be, local, 0);
    FP_CHECK_OK(r.status());
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    exposed = r->exposed_comm_seconds;
  }
  int64_t peak = mt.stats().peak_total - base;
  FP_CHECK_OK(world.all_reduce(&seconds, &seconds, 1, DType::kF64, ReduceOp::kMax));
  FP_CHECK_OK(world.all_reduce(&peak, &peak, 1, DType::kI64, ReduceOp::kMax));
  row.step_s.push_back(seconds);
  row.exposed_s.push_back(exposed);
  row.peak = peak;
  mt.release_cache();
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "configs/small.json", layouts_arg = "tsp=2,tp=2,sp=2,sp=2:ring", seq_arg = "4096,16384";
  int reps = 3;
  bool memory_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--model") model = value();
    else if (a == "--layouts") layouts_arg = value();
    else if (a == "--seq") seq_arg = value();
    else if (a == "--reps") reps = std::stoi(value());
    else if (a == "--memory-only") memory_only = true;
    else {
      std::fprintf(stderr, "layout_bench: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  Result<CommOptions> comm_options = CommOptions::from_env();
  MpiRuntime mpi(&argc, &argv, comm_options.ok() ? comm_options.value() : CommOptions());
  Communicator& world = mpi.world();
  set_cpu_backend_threads(1);
  Result<LlamaConfig> config = LlamaConfig::load(model);
  if (!config.ok()) {
    if (world.rank() == 0) std::fprintf(stderr, "layout_bench: %s\n", config.status().to_string().c_str());
    return 2;
  }
  // Specs are separated by ','; a 2-D layout is written with '+' ("tp=2+sp=2").
  std::vector<std::string> layouts;
  for (std::string s : split(layouts_arg, ',')) {
    std::replace(s.begin(), s.end(), '+', ',');
    layouts.push_back(s);
  }
  if (memory_only) reps = 1;
  if (world.rank() == 0)
    std::printf("%-7s %-16s %10s %12s %12s %11s %12s\n", "S", "layout", "step s", "tokens/s", "tok/s/rank",
                "exposed s", "peak MiB/rk");
  for (const std::string& s_str : split(seq_arg, ',')) {
    const int64_t S = std::stoll(s_str);
    const Batch global = synthetic_batch(config.value(), 1, S, 1);
    std::map<std::string, Row> rows;
    for (int rep = 0; rep < reps; ++rep)
      for (const std::string& spec : layouts) run_once(world, config.value(), spec, global, S, rows[spec]);
    if (world.rank() != 0) continue;
    for (const std::string& spec : layouts) {
      const Row& r = rows[spec];
      const double t = median(r.step_s);
      if (memory_only) {
        std::printf("%-7lld %-16s %10s %12s %12s %11s %12.1f\n", static_cast<long long>(S), spec.c_str(), "-", "-", "-",
                    "-", r.peak / 1048576.0);
      } else {
        std::printf("%-7lld %-16s %10.3f %12.1f %12.1f %11.3f %12.1f\n", static_cast<long long>(S), spec.c_str(), t,
                    static_cast<double>(S) / t, static_cast<double>(S) / t / world.size(), median(r.exposed_s),
                    r.peak / 1048576.0);
      }
    }
    std::fflush(stdout);
  }
  return 0;
}
