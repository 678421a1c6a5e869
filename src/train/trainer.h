// The training loop over any layout: a data-parallel axis (dp) around a model axis (tsp, tp,
// sp or tp x sp), gradient accumulation over micro-batches, AdamW on each rank's own
// parameters, global gradient-norm clipping, validation, checkpoints and metrics.
//
// Loss semantics: the reported loss, and the gradient, are those of the mean over all valid
// tokens of the GLOBAL batch, whatever the layout and the accumulation: every micro-batch's
// gradient is normalized by the global batch's valid-token count, known in advance from the
// data, and the data-parallel replicas sum their gradients.
//
// Where it runs is the caller's choice (TrainOptions::backend, ::axis_comm): by default the
// fast CPU backend and MPI communicators; `foldpar train --device cuda` passes the CUDA
// backend and device communicators (tools/device.h). This layer never sees CUDA.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "comm/mesh.h"
#include "core/status.h"
#include "parallel/sharded_model.h"
#include "train/optimizer.h"

namespace foldpar {

struct TrainOptions {
  LlamaConfig config;
  // Axes and knobs, e.g. dp=2,tsp=2:bf16 (layout/layout.h); none: tsp=<world size>.
  std::optional<Layout> layout;
  std::string data_dir;             // a prepared corpus (foldpar prepare-data)
  int64_t seq = 256;                // S
  int64_t batch = 8;                // sequences per optimizer step (global)
  int64_t micro_batch = 0;          // sequences per forward per data-parallel rank; 0: batch / dp
  int64_t steps = 100;              // optimizer steps in all (a resumed run continues to here)
  int64_t stop_after = 0;           // stop (with a checkpoint) after this step; 0: at `steps`
  OptimizerConfig optimizer;
  uint64_t seed = 0;                // weights and data order
  std::string out_dir;              // metrics.jsonl and checkpoints/ go here
  int64_t eval_every = 50;          // validation loss every this many steps (0: only at the end)
  int64_t eval_batches = 4;         // validation batches of `batch` windows each
  int64_t checkpoint_every = 0;     // 0: only at the end
  int keep_checkpoints = 2;
  CheckpointHooks checkpoint_hooks{};  // fault-test seams of every checkpoint save; empty: none
  bool resume = false;              // continue from the newest complete checkpoint in out_dir
  std::string init_from;            // start from these weights (a Hugging Face directory)
  // Rank 0's progress: a bar redrawn in place (tty), or a line every print_every steps;
  // print_every 0 prints nothing but validation and checkpoint notes.
  bool tty = false;
  int64_t print_every = 10;
  // Where the steps run; borrowed, and null for the default, like leveldb's Options::env.
  // A backend must compute the layout's dtype natively (the CUDA backend does bf16). Host
  // code reads tensor data only through the Backend's copies and the ops that return a
  // scalar (the loss, squared norms), which wait for the work before them, so ops need not
  // wait one by one (CudaBackendOptions::sync_each_op stays false). Null: the fast CPU
  // backend, decorated with bf16 storage (backend/bf16_storage_backend.h) for bf16.
  Backend* backend = nullptr;
  AxisCommFactory axis_comm;        // the mesh's axis communicators (Mesh::create); null: MPI's
};

struct TrainReport {
  int64_t steps_done = 0;           // steps run by this invocation
  int64_t final_step = 0;
  double last_loss = 0;
  double val_loss = 0;              // last validation loss
  double tokens_per_second = 0;     // median over this invocation's steps (global tokens)
  std::string checkpoint;           // the last checkpoint written
  std::vector<double> losses;       // every step's loss, in order
};

// The data-parallel sum of a step: every ParamRef's gradient (f32) summed over `dp` in place,
// each exactly once. What is replicated on the model axes (norm gains, the attention
// variants, KV replicas) is already complete on each of its ranks, so each copy sums with the
// same copies of the other replicas. Collective over dp; nothing issued for null or one rank.
void sum_grads_over_dp(Communicator* dp, std::vector<ParamRef>& params);

// Collective over `world`, which carries only host values (loss sums, counters, checkpoint
// agreement); gradients travel on the mesh's axis communicators.
Result<TrainReport> run_training(const TrainOptions& options, Communicator& world);

}  // namespace foldpar
