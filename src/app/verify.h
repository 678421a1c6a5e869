// `foldpar verify`: runs one forward + backward on the fast path and on the reference path
// from the same seed and compares the loss, the logits and every gradient under the
// tolerance policy (core/tolerance.h); optionally dumps everything for the PyTorch oracle
// (scripts/torch_reference.py).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/status.h"
#include "model/llama_model.h"
#include "parallel/sharded_model.h"

namespace foldpar {

struct VerifyOptions {
  LlamaConfig config;
  uint64_t seed = 0;         // weights and tokens
  int64_t batch = 2;         // B
  int64_t seq = 64;          // S
  Recompute recompute = Recompute::kNone;
  double tolerance = 0;      // 0: tol::kF32Model (single rank) or tol::kF32Parallel (a layout)
  std::string dump_dir;      // empty: no dump
  // The parallel layout to verify (recompute comes from `recompute`); none: the fast path
  // against the reference path on one rank.
  std::optional<Layout> layout;
};

struct TensorError {
  std::string name;          // "loss", "logits" or a Hugging Face parameter name (its gradient)
  double rel_error = 0;      // max|fast - ref| / max|ref|
};

struct VerifyReport {
  double loss = 0;            // fast path
  double loss_reference = 0;  // reference path
  int64_t valid_tokens = 0;
  std::vector<TensorError> errors;  // loss, logits, then every gradient in state-dict order
  double worst = 0;
  std::string worst_name;
  double tolerance = 0;
  bool passed = false;
  double fast_seconds = 0;
  double reference_seconds = 0;
  // With a layout: what each rank (world order) held and moved during the parallel step.
  std::string layout;
  std::vector<int64_t> peak_bytes;      // tracked peak per rank (parameters to activations)
  std::vector<int64_t> bytes_sent;      // counted bytes per rank
  std::vector<int64_t> bytes_received;
  int64_t single_rank_peak_bytes = 0;   // the same step on one rank
};

Result<VerifyReport> run_verify(const VerifyOptions& options);
// With options.layout: collective over `world`; the parallel model against the single-rank
// model from the same seed. Every rank returns the same report; rank 0 writes the dump.
Result<VerifyReport> run_verify_layout(const VerifyOptions& options, Communicator& world);

std::string verify_report_text(const VerifyReport& report);
std::string verify_report_json(const VerifyReport& report);

}  // namespace foldpar
