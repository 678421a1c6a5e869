// Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p
// (nucleus). Sampling draws from a counter-based uniform keyed by (seed, sequence, step), so a
// sequence's tokens depend on its seed and its index, not on the batch it runs in or on the
// rank that samples. Not collective.
#pragma once

#include <cstdint>
#include <span>

#include "core/status.h"

namespace foldpar {

struct SamplingOptions {
  // 0: greedy (the most likely token; the lowest id on ties). > 0: sample from
  // softmax(logits / temperature).
  double temperature = 0;
  int64_t top_k = 0;   // sample among the k most likely tokens only; 0: all
  double top_p = 1.0;  // ... among the fewest most likely tokens whose probability reaches top_p; in (0, 1]
  uint64_t seed = 0;

  // invalid_argument naming the value: negative temperature or top_k, top_p outside (0, 1].
  Status validate() const;
};

// The token for generation step `step` of sequence `sequence` from its logits [V] (finite f32).
int32_t sample_token(std::span<const float> logits, const SamplingOptions& options, uint64_t sequence, uint64_t step);

}  // namespace foldpar
