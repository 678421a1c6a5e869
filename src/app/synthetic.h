// Synthetic inputs for verification and benchmarks: random token sequences whose targets
// are the next token (a shifted copy), some of them ignored.
#pragma once

#include <cstdint>

#include "model/llama_model.h"

namespace foldpar {

// B sequences of S+1 random tokens from Rng(seed); input = tokens[0:S], target =
// tokens[1:S+1], each target replaced by kIgnoreIndex with probability ignore_fraction.
Batch synthetic_batch(const LlamaConfig& config, int64_t batch, int64_t seq, uint64_t seed,
                      double ignore_fraction = 0.05);

}  // namespace foldpar
