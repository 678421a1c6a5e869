// Dry run: one rank of a layout executes the real strategy code (make_sharded_model) on the
// meta backend (backend/meta/meta_backend.h), a counting mesh (comm/counting_communicator.h)
// and storage-less tensors (MemoryTracker::make_storageless), so the plan reads memory,
// traffic and the op sequence off the code itself instead of a hand-written replay
// (docs/design.md, Planning / dry run). Nothing is computed: a host access to tensor data
// fails loudly (Tensor::data<T>() FP_CHECK, or a fault named by the handler installed here),
// which is a bug in the strategy (every touch of tensor contents belongs in a Backend op).
// Many dry runs may run in one process, one at a time per thread; tensors made before are
// not affected.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "backend/meta/meta_backend.h"
#include "comm/counting_communicator.h"
#include "layout/layout.h"
#include "model/llama_config.h"
#include "plan/timeline.h"
#include "tensor/memory_tracker.h"

namespace foldpar {

enum class DryRunMode {
  kForwardBackward,  // one training micro-batch: ShardedModel::forward_backward
  kForward,          // forward only (the loss): ShardedModel::forward
  kPrefill,          // generation: ShardedDecoder::prefill of B prompts of S tokens
  kDecode,           // generation: one decode step after that prefill (the step's figures)
};

struct DryRunOptions {
  LlamaConfig config;
  Layout layout;                  // validated by validate_layout inside
  int rank = 0;                   // world rank in layout.mesh(), 0 <= rank < its rank count
  int64_t batch = 1;              // B, global rows (a dp axis divides it as the trainer does)
  int64_t seq = 0;                // S
  DryRunMode mode = DryRunMode::kForwardBackward;
  bool matmul_takes_bf16 = false; // what the meta backend answers (bf16 layouts on a bf16 GEMM)
  // bf16 layouts: false runs them as `train --bf16` does on the CPU, through the bf16
  // storage decorator (its widened f32 copies counted, attention and token-wise ops in
  // f32); true as a backend that stores and reads bf16 itself (the CUDA backend): every op
  // on bf16 tensors, no decorator copies. Needs matmul_takes_bf16.
  bool bf16_native = false;
  int64_t max_new_tokens = 1;     // kPrefill, kDecode: the KV cache's room past the prompt
  // kForwardBackward: sequences per forward per data-parallel rank (train --micro-batch);
  // 0: all of them, one micro-batch. m = (batch / dp) / micro_batch micro-batches run as the
  // trainer runs them (forward_backward_micro_batches: a pipeline's schedule).
  int64_t micro_batch = 0;
  // MoE models: routing is data-dependent and a dry run has no data; it assumes the routing
  // of planned_moe_routing (backend/meta/meta_backend.h) on every rank: balanced at 1
  // (each expert T*k/E rows, each rank T*k/D rows to each rank), expert 0 this many times
  // its balanced share above 1 (needs k < E). The counts and expert ids the TSP schemes
  // exchange are then known to the meta backend, as every rank holding the same routing
  // would deliver them, so every transfer and buffer has the size a real run with that
  // routing gives.
  double moe_imbalance = 1.0;
};

struct DryRunResult {
  MemoryStats after_build;  // the tracker once the model and the local batch exist
  MemoryStats step;         // peaks of the step alone (reset after the build), currents after it
  std::vector<std::pair<std::string, CommStats>> comm;  // what each axis moved in the step, layout order
  std::vector<OpRecord> ops;  // the meta backend's records
  CommTrace comm_trace;       // starts and completions; seq numbers merge with ops'
  StepResult result;          // loss fields are 0: nothing is computed (training modes)
  uint64_t step_first_seq = 0;  // ops and comm events from this sequence number on are the step's
};

// Runs one step of `options.layout` as world rank `options.rank`. Errors: the layout's
// verdict (validate_layout for every mode, then make_sharded_decoder's for the generation modes),
// a micro_batch that does not divide batch / dp or gives fewer micro-batches than stages
// (validate_micro_batches), a bad moe_imbalance, or a rank outside the mesh. Not collective; no MPI.
Result<DryRunResult> dry_run(const DryRunOptions& options);

// The step's records (seq >= step_first_seq) as the timeline's input (plan/timeline.h), in
// program order: each op a ComputeEvent classed by its name and shape, each communicator
// start a CommStart (blocking ones need no wait) on the link class of the communicator's
// world ranks, each completion a CommWait. invalid_argument for devices_per_node < 1.
Result<RankTrace> step_timeline_trace(const DryRunResult& result, int rank, int devices_per_node);

}  // namespace foldpar
