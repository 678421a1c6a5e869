// SequenceShard: which tokens of a sequence a rank holds on a sequence-sharded axis (TSP,
// SP). Zigzag: the sequence is cut into 2D equal chunks c_0..c_{2D-1} and rank p holds c_p
// then c_{2D-1-p}, so every rank does the same causal attention work. Contiguous: rank p
// holds the p-th block of S/D tokens. Local rows keep that order; every position-dependent
// computation uses the global positions returned here.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "layout/layout.h"
#include "model/llama_model.h"

namespace foldpar {

class SequenceShard {
 public:
  // Rank `rank` of `degree`. validate_layout (layout/) is the check that S divides as the
  // split needs (zigzag: S % 2D == 0; contiguous: S % D == 0); here it is an FP_CHECK.
  static SequenceShard create(int64_t seq, int degree, int rank, SeqSplit split);

  int64_t seq() const { return seq_; }            // S
  int64_t local_seq() const { return seq_ / degree_; }  // S / D
  int degree() const { return degree_; }
  int rank() const { return rank_; }
  SeqSplit split() const { return split_; }

  // Global position of each local row, in local order: i32-ready values in [0, S).
  const std::vector<int32_t>& positions() const { return positions_; }
  // Positions of every rank's rows, rank by rank: the order an all-gather of per-rank
  // tensors produces (for k_pos of gathered keys).
  std::vector<int32_t> gathered_positions() const;

  // The local rows [B, S/D] of a global batch [B, S] (a copy).
  Batch local_batch(const Batch& global) const;
  // Copies local rows [B, S/D, ...] of `local` into their global places in `global`
  // [B, S, ...] (both row-major with the same trailing extents).
  void scatter_to_global(const Tensor& local, Tensor& global) const;

 private:
  SequenceShard(int64_t seq, int degree, int rank, SeqSplit split, std::vector<int32_t> positions)
      : seq_(seq), degree_(degree), rank_(rank), split_(split), positions_(std::move(positions)) {}

  int64_t seq_;
  int degree_;
  int rank_;
  SeqSplit split_;
  std::vector<int32_t> positions_;
};

// Positions of rank `rank`'s rows (no validation).
std::vector<int32_t> shard_positions(int64_t seq, int degree, int rank, SeqSplit split);

// The rows at `positions` (global, in local order) of a global batch [B, S]: [B, n] (a copy).
Batch batch_rows_at(const Batch& global, std::span<const int32_t> positions);
// Copies local rows [B, n, ...] into their places `positions` of `global` [B, S, ...] (both
// row-major with the same trailing extents; other rows left).
void scatter_rows_to(const Tensor& local, std::span<const int32_t> positions, Tensor& global);

}  // namespace foldpar
