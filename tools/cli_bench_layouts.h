// `foldpar bench --layouts` and `foldpar bench --calibrate`: the flags they add to `bench`
// and their run. Included by main.cc only, so that CLI11 stays in one translation unit. What
// they measure lives in src/app/layout_bench.h; here: flags in, table and files out.
//
//   mpirun -np 2 foldpar bench --layouts tsp=2,tp=2,sp=2,sp=2:ring --model configs/small.json
//       --seq 1024,4096 [--steps 3] [--hardware hardware/this-machine.json] [--out DIR]
//     prints the side-by-side table (rank 0); DIR receives table.csv, table.json and PNGs.
//   mpirun -np 2 foldpar bench --calibrate [--out hardware/this-machine.json]
//     prints (and writes) a hardware description measured here.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <string>

#include "app/layout_bench.h"
#include "comm/mpi_runtime.h"
#include "cli_layout.h"
#include "core/status.h"

namespace foldpar::cli {

struct BenchLayoutsArgs {
  std::vector<std::string> layouts;
  std::string out, hardware;
  bool calibrate = false, memory_only = false, forward = false;

  bool active() const { return !layouts.empty() || calibrate; }
};

// Adds the flags to the existing `bench` subcommand; --model stays required for everything
// but --calibrate (checked by run_bench_layouts and main's dispatch).
inline void add_bench_layouts(CLI::App* bench, BenchLayoutsArgs& a) {
  bench->add_option("--layouts", a.layouts,
                    "run these layouts side by side under mpirun: tsp=2 tp=2 sp=2:ring tp=2,sp=2:seqpar (spaces "
                    "separate layouts, ',' joins axes, ':' adds ring, seqpar, contiguous, nooverlap, keepw, keepkv, "
                    "buckets=N, recompute, bf16)");
  bench->add_option("--out", a.out, "--layouts: directory for table.csv, table.json and PNGs; --calibrate: JSON file");
  bench->add_option("--hardware", a.hardware, "--layouts: hardware JSON for the predicted step time");
  bench->add_flag("--calibrate", a.calibrate, "measure this machine's hardware description (mpirun -np 2)");
  bench->add_flag("--memory-only", a.memory_only, "--layouts: one step per layout, peaks only (oversubscribed runs)");
  bench->add_flag("--forward", a.forward, "--layouts: forward steps (with the loss) instead of training steps");
  bench->get_option("--model")->required(false);
}

template <typename BenchArgsT>
Result<LayoutBenchOptions> layout_bench_options(const BenchLayoutsArgs& a, const BenchArgsT& base, Hardware& hw) {
  if (base.model.empty()) return invalid_argument("bench --layouts: --model is required");
  LayoutBenchOptions o;
  FP_ASSIGN_OR_RETURN(o.config, LlamaConfig::load(base.model));
  FP_ASSIGN_OR_RETURN(o.layouts, layouts_of(a.layouts));
  if (base.recompute == Recompute::kBlock)
    for (Layout& l : o.layouts) l.recompute = Recompute::kBlock;
  o.seqs = base.seqs;
  o.batch = base.batch;
  o.reps = base.steps;
  o.memory_only = a.memory_only;
  o.forward_only = a.forward;
  if (!a.hardware.empty()) {
    FP_ASSIGN_OR_RETURN(hw, Hardware::load(a.hardware));
    o.hardware = &hw;
  }
  return o;
}

template <typename BenchArgsT>
int run_bench_layouts(const BenchLayoutsArgs& a, const BenchArgsT& base, int (*fail)(const Status&)) {
  if (a.calibrate && !a.layouts.empty()) return fail(invalid_argument("give --calibrate or --layouts, not both"));
  Hardware hw;
  LayoutBenchOptions o;
  if (!a.calibrate) {
    Result<LayoutBenchOptions> parsed = layout_bench_options(a, base, hw);
    if (!parsed.ok()) return fail(parsed.status());
    o = *parsed;
  }
  Result<CommOptions> comm_options = CommOptions::from_env();
  if (!comm_options.ok()) return fail(comm_options.status());
  MpiRuntime mpi(nullptr, nullptr, comm_options.value());
  Communicator& world = mpi.world();
  set_cpu_backend_threads(1);
  const bool root = world.rank() == 0;
  if (a.calibrate) {
    Result<Hardware> h = calibrate_hardware(world);
    if (!h.ok()) return fail(h.status());
    if (root) {
      std::fputs(h->to_json().c_str(), stdout);
      if (!a.out.empty()) {
        std::ofstream f(a.out);
        f << h->to_json();
        if (!f) return fail(io_error("cannot write '{}'", a.out));
      }
    }
    return 0;
  }
  Result<std::vector<LayoutBenchRow>> rows = run_layout_bench(o, world);
  if (!rows.ok()) return fail(rows.status());
  if (!root) return 0;
  std::fputs(layout_bench_text(*rows).c_str(), stdout);
  if (!a.out.empty()) {
    Result<std::vector<std::string>> files = write_layout_bench(*rows, a.out);
    if (!files.ok()) return fail(files.status());
    for (const std::string& f : *files) std::printf("wrote %s\n", f.c_str());
  }
  return 0;
}

}  // namespace foldpar::cli
