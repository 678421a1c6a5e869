// Timing of single-rank training steps (forward + backward) on the fast CPU backend, or on
// the backend the caller passes (`foldpar bench --device cuda`): the figure `foldpar bench`
// prints and bench/train_step_bench records beside sgemm.
#pragma once

#include <cstdint>
#include <vector>

#include <map>
#include <string>

#include "backend/timed_backend.h"
#include "core/status.h"
#include "model/llama_model.h"
#include "tensor/memory_tracker.h"

namespace foldpar {

struct StepBenchOptions {
  LlamaConfig config;
  int64_t batch = 1;   // B
  int64_t seq = 1024;  // S
  int warmup = 1;      // untimed steps first
  int steps = 3;       // timed steps (the median is reported)
  Recompute recompute = Recompute::kNone;
  uint64_t seed = 0;
  bool profile = false;  // time every backend op (TimedBackend)
  // bf16 storage as `train --bf16` runs it on one rank: bf16 weights and activations, f32
  // gradients; through the bf16 storage decorator over the CPU backend (bf16 products where
  // the CPU has them), natively on a borrowed backend (CUDA; the trainer does the same).
  bool bf16 = false;
  // Borrowed; null: the fast CPU backend. The loss is read after each step through the
  // Backend, which waits for the step's work, so step times are those of finished work; a
  // per-op profile of a GPU backend needs CudaBackendOptions::sync_each_op as well.
  Backend* backend = nullptr;
};

struct StepBenchReport {
  std::vector<double> step_seconds;  // every timed step
  double median_seconds = 0;
  double tokens_per_second = 0;      // B*S / median
  double flops_per_step = 0;         // useful FLOPs (model/flop_count.h)
  double gflops = 0;                 // flops_per_step / median / 1e9
  MemoryStats memory;                // tracked peaks over the whole run, weights and gradients included
  int64_t peak_rss_bytes = 0;        // the process's resident peak (getrusage), for comparison with peers
                                     // (with CUDA: host pages only)
  double loss = 0;                   // of the last step (finite, as a sanity check)
  std::map<std::string, OpTime> op_times;  // with profile: per op, summed over the timed steps
};

Result<StepBenchReport> run_step_bench(const StepBenchOptions& options);

}  // namespace foldpar
