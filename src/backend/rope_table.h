// RoPE cos/sin tables at explicit global positions, Hugging Face Llama convention:
// inv_freq[i] = theta^(-2i/d) for i < d/2, angle = pos * inv_freq[i], with the rope_scaling
// variants of Hugging Face transformers' modeling_rope_utils (linear, dynamic, llama3, yarn)
// applied to inv_freq and yarn's attention factor to cos and sin.
// Everything is computed in double and rounded once at the end, so rope_theta in the millions
// and positions up to 2^31 keep their angles to ~1e-10 rad (f32 angles would be ~0.06 rad off
// at position 1M). The table is all a layout needs: scaling reaches every layout and decode.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace foldpar {

// config.json "rope_scaling", as Hugging Face reads it ("rope_type", or the older "type").
struct RopeScaling {
  enum class Type { kDefault, kLinear, kDynamic, kLlama3, kYarn };
  Type type = Type::kDefault;
  double factor = 1.0;  // linear/dynamic/llama3/yarn: the context extension factor (> 0)
  // llama3 (required) and yarn (optional; 0 = max_position_embeddings): the pretrained context.
  int64_t original_max_position_embeddings = 0;
  double low_freq_factor = 1.0;   // llama3: wavelengths above original/low are divided by factor
  double high_freq_factor = 4.0;  // llama3: wavelengths below original/high are kept
  double beta_fast = 32.0;        // yarn: rotations where the ramp starts extrapolating
  double beta_slow = 1.0;         // yarn: rotations where the ramp ends interpolating
  double attention_factor = 0.0;  // yarn: cos/sin scale; 0 = derived from factor (and mscale)
  double mscale = 0.0, mscale_all_dim = 0.0;  // yarn (DeepSeek style): both set -> their ratio
  bool truncate = true;           // yarn: floor/ceil the correction range
  bool enabled() const { return type != Type::kDefault; }
};
const char* rope_type_name(RopeScaling::Type type);

// What a RoPE table is a function of, besides the positions.
struct RopeSpec {
  int64_t head_dim = 0;                 // d, even
  double theta = 10000.0;               // rope_theta
  int64_t max_position_embeddings = 0;  // dynamic's and yarn's reference length
  RopeScaling scaling;
};

// The d/2 inverse frequencies and the factor on cos/sin, in double. `seq_len` is the length
// of the whole sequence the positions belong to (max position + 1, over every rank): only
// dynamic reads it (Hugging Face's dynamic_rope_update: NTK rescale of theta once seq_len
// exceeds max_position_embeddings).
struct RopeFrequencies {
  std::vector<double> inv_freq;  // [d/2]
  double attention_factor = 1.0;
};
RopeFrequencies rope_frequencies(const RopeSpec& spec, int64_t seq_len);

// Returns [positions.size(), 2, d/2]: row p holds cos of its d/2 angles, then their sin, each
// times the attention factor, computed in double and rounded to `dtype` (f32 or f64).
// Computed on the host, then copied into the table with be.copy_from_host.
Tensor build_rope_table(Backend& be, std::span<const int32_t> positions, const RopeSpec& spec, int64_t seq_len,
                        DType dtype, MemCategory category = MemCategory::kActivations);
// Unscaled RoPE of head dim `head_dim` and base `theta`.
Tensor build_rope_table(Backend& be, std::span<const int32_t> positions, int64_t head_dim, double theta,
                        DType dtype, MemCategory category = MemCategory::kActivations);

}  // namespace foldpar
