// RoPE cos/sin tables at explicit global positions, Hugging Face Llama convention:
// inv_freq[i] = theta^(-2i/d) for i < d/2, angle = pos * inv_freq[i].
#pragma once

#include <cstdint>
#include <span>

#include "backend/backend.h"

namespace foldpar {

// Returns [positions.size(), 2, d/2]: row p holds cos of its d/2 angles, then their sin. With dtype f32 the
// angle is formed in f32 exactly as Hugging Face's LlamaRotaryEmbedding does (f32 inv_freq,
// f32 product), then cos/sin are rounded to f32, so foldpar and PyTorch rotate by the same
// angles even at long positions. With f64 everything is f64 (for finite differences).
// Computed on the host, then copied into the table with be.copy_from_host.
Tensor build_rope_table(Backend& be, std::span<const int32_t> positions, int64_t head_dim, double theta,
                        DType dtype, MemCategory category = MemCategory::kActivations);

}  // namespace foldpar
