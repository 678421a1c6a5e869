// `foldpar bench-layouts` and `foldpar calibrate`, as the old spellings `bench --layouts` and
// `bench --calibrate` (tools/cmd_bench.cc) also run them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/llama_model.h"

namespace foldpar::cli {

struct BenchLayoutsArgs {
  std::string model, out, hardware;
  std::vector<std::string> layouts;
  std::vector<int64_t> seqs{1024};
  int64_t batch = 1;
  int64_t micro_batch = 0;  // pp layouts: sequences per micro-batch (0: one)
  int steps = 3;
  int warmup = 1;
  bool profile = false;
  Recompute recompute = Recompute::kNone;
  bool memory_only = false, forward = false;
};

// Under mpirun: the side-by-side table on rank 0; --out receives table.csv, table.json, PNGs.
int run_bench_layouts(const BenchLayoutsArgs& a);

// Under mpirun -np 2: this machine's hardware description on stdout, and in `out` if given.
int run_calibrate(const std::string& out);

}  // namespace foldpar::cli
