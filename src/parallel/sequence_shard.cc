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
  // One rank holds the whole sequence in order whatever the split (zigzag's two chunks of a
  // degree-1 split are the sequence itself, and an odd S has no two equal chunks).
  if (split == SeqSplit::kZigzag && degree > 1) {
    const int64_t chunk = seq / (2 * degree);
    append_chunk(rank * chunk, chunk);
    append_chunk((2 * degree - 1 - rank) * chunk, chunk);
  } else {
    const int64_t block = seq / degree;
    append_chunk(rank * block, block);
  }
  return pos;
}

SequenceShard SequenceShard::create(int64_t seq, int degree, int rank, SeqSplit split) {
  // validate_layout (layout/) refuses, with the user's numbers, every S the split cannot
  // cut; reaching here with one is a bug.
  const int64_t pieces = split == SeqSplit::kZigzag && degree > 1 ? 2 * int64_t{degree} : degree;
  FP_CHECK(degree > 0 && rank >= 0 && rank < degree && seq > 0 && seq % pieces == 0,
           "sequence shard: rank {} of degree {} at S={} ({} pieces; validate_layout passes first)", rank, degree,
           seq, pieces);
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
  FP_CHECK(global.seq() == seq_, "batch of S={} for a shard of S={}", global.seq(), seq_);
  return batch_rows_at(global, positions_);
}

void SequenceShard::scatter_to_global(const Tensor& local, Tensor& global) const {
  FP_CHECK(global.dim(1) == seq_, "scatter of {} into {}", local.describe(), global.describe());
  scatter_rows_to(local, positions_, global);
}

// Through host copies (Tensor::copy_to_host/copy_from_host, so the ids may be device
// memory): ShardedModel::local_batch, which calls this for every micro-batch, takes no
// Backend yet (to become copy_strided runs when the interface passes one).
Batch batch_rows_at(const Batch& global, std::span<const int32_t> positions) {
  const int64_t B = global.batch(), S = global.seq(), n = static_cast<int64_t>(positions.size());
  Batch out;
  out.input_ids = Tensor::empty({B, n}, DType::kI32, MemCategory::kActivations);
  out.target_ids = Tensor::empty({B, n}, DType::kI32, MemCategory::kActivations);
  auto gather = [&](const Tensor& from, Tensor& to) {
    std::vector<int32_t> all(static_cast<size_t>(B * S)), rows(static_cast<size_t>(B * n));
    from.copy_to_host(std::as_writable_bytes(std::span<int32_t>(all)));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n; ++i) rows[static_cast<size_t>(b * n + i)] = all[static_cast<size_t>(b * S + positions[i])];
    to.copy_from_host(std::as_bytes(std::span<const int32_t>(rows)));
  };
  gather(global.input_ids, out.input_ids);
  gather(global.target_ids, out.target_ids);
  return out;
}

// Not a step path: assembles verification logits (assemble_logits) on the host.
void scatter_rows_to(const Tensor& local, std::span<const int32_t> positions, Tensor& global) {
  const int64_t B = global.dim(0), S = global.dim(1), n = static_cast<int64_t>(positions.size());
  FP_CHECK(local.dim(0) == B && local.dim(1) == n && local.dtype() == global.dtype() &&
               local.numel() / (B * n) == global.numel() / (B * S),
           "scatter of {} into {}", local.describe(), global.describe());
  const size_t row_bytes = local.nbytes() / static_cast<size_t>(B * n);
  const auto* src = static_cast<const char*>(local.raw_data());
  auto* dst = static_cast<char*>(global.raw_data());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(dst + (b * S + positions[i]) * row_bytes, src + (b * n + i) * row_bytes, row_bytes);
}

}  // namespace foldpar
