// Synthetic batches.
#include "app/synthetic.h"

#include <vector>

#include "core/rng.h"

namespace foldpar {

Batch synthetic_batch(const LlamaConfig& c, int64_t B, int64_t S, uint64_t seed, double ignore_fraction) {
  Batch batch;
  batch.input_ids = Tensor::empty({B, S}, DType::kI32, MemCategory::kActivations);
  batch.target_ids = Tensor::empty({B, S}, DType::kI32, MemCategory::kActivations);
  Rng rng(seed);
  std::vector<int32_t> tokens(static_cast<size_t>(S + 1));
  // Made on the host, stored with one explicit copy each (the batch may be device memory).
  std::vector<int32_t> inputs(static_cast<size_t>(B * S)), targets(static_cast<size_t>(B * S));
  for (int64_t b = 0; b < B; ++b) {
    for (auto& t : tokens) t = static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.vocab_size)));
    for (int64_t s = 0; s < S; ++s) {
      inputs[static_cast<size_t>(b * S + s)] = tokens[s];
      targets[static_cast<size_t>(b * S + s)] = rng.uniform() < ignore_fraction ? kIgnoreIndex : tokens[s + 1];
    }
  }
  batch.input_ids.copy_from_host(std::as_bytes(std::span<const int32_t>(inputs)));
  batch.target_ids.copy_from_host(std::as_bytes(std::span<const int32_t>(targets)));
  return batch;
}

}  // namespace foldpar
