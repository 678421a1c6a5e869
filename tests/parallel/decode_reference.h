// What the decode tests compare against: random prompt tokens and the single-rank model's
// logits at every position of one sequence (tests/parallel/decode_test.cc,
// pipeline_decode_test.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "core/rng.h"
#include "model/llama_model.h"

namespace foldpar::test {

inline std::vector<int32_t> random_tokens(const LlamaConfig& c, int64_t n, uint64_t stream) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    t[static_cast<size_t>(i)] = static_cast<int32_t>(uniform_at(11, stream, static_cast<uint64_t>(i)) * c.vocab_size);
  return t;
}

// The single-rank model's logits [n, V] at every position of one sequence.
inline Tensor reference_logits(const LlamaConfig& c, const LlamaWeights& w, const std::vector<int32_t>& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  Batch batch{Tensor::empty({1, n}, DType::kI32, MemCategory::kWorkspace),
              Tensor::empty({1, n}, DType::kI32, MemCategory::kWorkspace)};
  std::copy(tokens.begin(), tokens.end(), batch.input_ids.data<int32_t>());
  std::copy(tokens.begin(), tokens.end(), batch.target_ids.data<int32_t>());
  auto be = make_cpu_backend();
  Result<StepResult> r = model_forward(c, *be, w, batch, StepOptions{Recompute::kNone, true});
  FP_CHECK_OK(r.status());
  return r->logits.reshape({n, c.vocab_size});
}

}  // namespace foldpar::test
