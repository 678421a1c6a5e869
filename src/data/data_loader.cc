// Deterministic batches from a token file.
#include "data/data_loader.h"

#include "core/rng.h"

namespace foldpar {

Result<DataLoader> DataLoader::create(std::shared_ptr<const TokenFile> tokens, int64_t seq, uint64_t seed) {
  if (seq <= 0) return invalid_argument("sequence length ({}) must be positive", seq);
  const int64_t n = static_cast<int64_t>(tokens->ids.size());
  if (n < seq + 1)
    return invalid_argument("the token file holds {} tokens, fewer than one window of S + 1 = {}", n, seq + 1);
  return DataLoader(std::move(tokens), seq, seed);
}

Batch DataLoader::rows_at(const std::vector<int64_t>& offsets) const {
  const int64_t rows = static_cast<int64_t>(offsets.size()), S = seq_;
  Batch b;
  b.input_ids = Tensor::empty({rows, S}, DType::kI32, MemCategory::kActivations);
  b.target_ids = Tensor::empty({rows, S}, DType::kI32, MemCategory::kActivations);
  // Assembled on the host, then one explicit host copy each (the tensors may be device memory).
  const int32_t* ids = tokens_->ids.data();
  std::vector<int32_t> input(static_cast<size_t>(rows * S)), target(static_cast<size_t>(rows * S));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(ids + offsets[r], S, input.data() + r * S);
    std::copy_n(ids + offsets[r] + 1, S, target.data() + r * S);
  }
  b.input_ids.copy_from_host(std::as_bytes(std::span<const int32_t>(input)));
  b.target_ids.copy_from_host(std::as_bytes(std::span<const int32_t>(target)));
  return b;
}

Batch DataLoader::train_rows(uint64_t index, int64_t row_begin, int64_t row_end) const {
  const uint64_t starts = tokens_->ids.size() - static_cast<uint64_t>(seq_);  // offsets 0 .. n - S - 1
  std::vector<int64_t> offsets;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint64_t h = hash_u64(seed_, index, static_cast<uint64_t>(r));
    offsets.push_back(static_cast<int64_t>(h % starts));
  }
  return rows_at(offsets);
}

int64_t DataLoader::windows() const { return static_cast<int64_t>(tokens_->ids.size() - 1) / seq_; }

Batch DataLoader::sequential_rows(uint64_t index, int64_t batch, int64_t row_begin, int64_t row_end) const {
  std::vector<int64_t> offsets;
  const int64_t w = windows();
  for (int64_t r = row_begin; r < row_end; ++r)
    offsets.push_back(((static_cast<int64_t>(index) * batch + r) % w) * seq_);
  return rows_at(offsets);
}

}  // namespace foldpar
