// Zigzag and contiguous sequence sharding.
#include "parallel/sequence_shard.h"

#include <cstring>

namespace foldpar {

std::vector<int32_t> shard_positions(int64_t seq, int degree, int rank, SeqSplit split) {
  std::vector<int32_t> pos;
  pos.reserve(static_cast<size_t>(seq / degree));
  auto append_chunk = [&](int64_t begin, int64_t len) {
    for (int64_t i = 0; i < len; ++i) pos.push_back(static_cast<int32_t>(begin + i));
  };
  if (split == SeqSplit::kZigzag) {
    const int64_t chunk = seq / (2 * degree);
    append_chunk(rank * chunk, chunk);
    append_chunk((2 * degree - 1 - rank) * chunk, chunk);
  } else {
    const int64_t block = seq / degree;
    append_chunk(rank * block, block);
  }
  return pos;
}

Result<SequenceShard> SequenceShard::create(int64_t seq, int degree, int rank, SeqSplit split) {
  if (degree <= 0 || rank < 0 || rank >= degree)
    return invalid_argument("sequence shard: rank {} of degree {}", rank, degree);
  if (seq <= 0) return invalid_argument("sequence length ({}) must be positive", seq);
  if (split == SeqSplit::kZigzag && seq % (2 * degree) != 0)
    return invalid_argument("sequence length ({}) must be divisible by 2 x the sequence degree (2 x {} = {}) for the "
                            "zigzag split",
                            seq, degree, 2 * degree);
  if (split == SeqSplit::kContiguous && seq % degree != 0)
    return invalid_argument("sequence length ({}) must be divisible by the sequence degree ({})", seq, degree);
  return SequenceShard(seq, degree, rank, split, shard_positions(seq, degree, rank, split));
}

std::vector<int32_t> SequenceShard::gathered_positions() const {
  std::vector<int32_t> all;
  all.reserve(static_cast<size_t>(seq_));
  for (int r = 0; r < degree_; ++r) {
    const std::vector<int32_t> p = shard_positions(seq_, degree_, r, split_);
    all.insert(all.end(), p.begin(), p.end());
  }
  return all;
}

Batch SequenceShard::local_batch(const Batch& global) const {
  const int64_t B = global.batch(), S = global.seq(), local = local_seq();
  FP_CHECK(S == seq_, "batch of S={} for a shard of S={}", S, seq_);
  Batch out;
  out.input_ids = Tensor::empty({B, local}, DType::kI32, MemCategory::kActivations);
  out.target_ids = Tensor::empty({B, local}, DType::kI32, MemCategory::kActivations);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < local; ++i) {
      out.input_ids.data<int32_t>()[b * local + i] = global.input_ids.data<int32_t>()[b * S + positions_[i]];
      out.target_ids.data<int32_t>()[b * local + i] = global.target_ids.data<int32_t>()[b * S + positions_[i]];
    }
  return out;
}

void SequenceShard::scatter_to_global(const Tensor& local, Tensor& global) const {
  const int64_t B = global.dim(0), local_rows = local_seq();
  FP_CHECK(global.dim(1) == seq_ && local.dim(0) == B && local.dim(1) == local_rows && local.dtype() == global.dtype() &&
               local.numel() / (B * local_rows) == global.numel() / (B * seq_),
           "scatter of {} into {}", local.describe(), global.describe());
  const size_t row_bytes = local.nbytes() / static_cast<size_t>(B * local_rows);
  const auto* src = static_cast<const char*>(local.raw_data());
  auto* dst = static_cast<char*>(global.raw_data());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < local_rows; ++i)
      std::memcpy(dst + (b * seq_ + positions_[i]) * row_bytes, src + (b * local_rows + i) * row_bytes, row_bytes);
}

}  // namespace foldpar
