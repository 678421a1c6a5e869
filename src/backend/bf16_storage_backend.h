// Bf16StorageBackend: bf16 as a storage type for any backend that computes in f32. A
// decorator: every bf16 input is widened to an f32 workspace copy, every bf16 output is
// computed in f32 and rounded to bf16 once (accumulated outputs are widened first), and
// f32 tensors pass through untouched, so an all-f32 call costs nothing extra. matmul is the
// exception where the inner backend multiplies bf16 natively (Backend::matmul_takes_bf16):
// bf16 operands go to it as they are, products accumulate in f32 there; so are attention's
// forward and backward (bf16 tile products, f32 softmax, backend.h). This is how
// `train --bf16` halves the bytes of stored weights, activations and the shards that
// travel, while arithmetic (and the parity tests' references) stay f32. Widening and
// rounding are the inner backend's copy (Backend::copy converts f32 <-> bf16), so the
// decorator touches no tensor data itself: over the meta backend a dry run of a bf16
// layout counts its workspace copies exactly as a real run allocates them.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace foldpar {

// `inner` must outlive the returned backend.
std::unique_ptr<Backend> make_bf16_storage_backend(Backend& inner);

// The dtype of per-row statistics (RMSNorm's rstd, attention's and the loss's log-sum-exp)
// next to activations of dtype `d`: bf16's 8 bits are too few for a log-sum-exp, so they
// stay f32.
constexpr DType stat_dtype(DType d) { return d == DType::kBF16 ? DType::kF32 : d; }

}  // namespace foldpar
