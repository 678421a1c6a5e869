// Predicted memory per rank: what foldpar's own implementation allocates through the
// tracked allocator (tensor/memory_tracker.h), by category, at the peak of one step. The
// model replays, buffer by buffer, the allocations of each strategy's step (parallel/tsp,
// tp, sp, tpsp: saved activations per recomputation policy, weight shards in flight,
// gathered K/V, collective staging buffers, logits chunks, flash-attention workspace) in
// the order the code makes them, and keeps the largest total. plan_validation_test holds
// it to the measured tracked peak (within 10%).
//
// What a peak counts (as the tracker does): requested bytes of live tensors; not the
// allocator's cache, not MPI's internal buffers, not the program text. The optimizer's
// AdamW moments (and f32 master weights under bf16) live across steps and are reported
// beside the step's peak; `total()` adds them.
//
// Held to measurement: training and forward steps of every layout, and tsp/tp prefill and
// decode. Decode counts the weights, the KV cache (exact) and O(B h + B V/D) of transients
// (an estimate, within 1% at the test's sizes, where weights and cache dominate).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "core/status.h"
#include "model/llama_config.h"
#include "plan/layout_spec.h"
#include "plan/traffic_model.h"
#include "tensor/memory_tracker.h"

namespace foldpar {

struct MemoryEstimate {
  // Bytes live in each category (MemCategory order) at the predicted peak of the step.
  std::array<int64_t, kNumMemCategories> at_peak{};
  int64_t peak = 0;       // the step's tracked peak: sum of at_peak
  int64_t optimizer = 0;  // AdamW m and v (f32), plus f32 master weights under bf16
  std::string phase;      // where the peak falls, e.g. "attention backward, layer 31"

  int64_t of(MemCategory c) const { return at_peak[static_cast<int>(c)]; }
  // What must fit on the device: the step's peak plus the optimizer state (training).
  int64_t total() const { return peak + optimizer; }
};

struct MemoryRequest {
  int64_t batch = 1;          // B: sequences of the global micro-batch (split over dp)
  int64_t seq = 0;            // S
  PlanMode mode = PlanMode::kTrain;
  // Generation: tokens the KV cache is planned for beyond the prompt (prefill, decode).
  int64_t max_new_tokens = 0;
  // Whether the local batch's token ids (i32 [B, S_local] twice) count; the benches and
  // tests make them inside the measured region.
  bool count_batch = true;
};

// invalid_argument for sizes that do not divide (check_layout_sizes) and for modes the layout
// does not run.
Result<MemoryEstimate> predict_memory(const LlamaConfig& config, const Layout& layout, const MemoryRequest& request);

}  // namespace foldpar
