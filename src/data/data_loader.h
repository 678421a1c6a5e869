// DataLoader: batches of training windows from a token file, deterministic from a seed.
// Batch number k's row b is the window of S+1 tokens starting at an offset drawn from
// (seed, k, b) by the counter-based generator: any rank can make any rows of any batch
// without the others, so the loader's whole state is the next batch number (saved in a
// checkpoint), the data-parallel split is a choice of rows, and resuming is exact.
#pragma once

#include <cstdint>
#include <memory>

#include "io/token_file.h"
#include "model/llama_model.h"

namespace foldpar {

class DataLoader {
 public:
  // invalid_argument when the file is shorter than one window (S + 1 tokens).
  static Result<DataLoader> create(std::shared_ptr<const TokenFile> tokens, int64_t seq, uint64_t seed);

  // Rows [row_begin, row_end) of training batch `index`: input = window[0:S], target =
  // window[1:S+1]. i32 [rows, S].
  Batch train_rows(uint64_t index, int64_t row_begin, int64_t row_end) const;
  // Validation batch `index`: consecutive non-overlapping windows from the start of the
  // file (rows [row_begin, row_end) of a batch of `batch` rows); wraps around.
  Batch sequential_rows(uint64_t index, int64_t batch, int64_t row_begin, int64_t row_end) const;
  // How many non-overlapping windows of S+1 tokens the file holds.
  int64_t windows() const;

 private:
  DataLoader(std::shared_ptr<const TokenFile> tokens, int64_t seq, uint64_t seed)
      : tokens_(std::move(tokens)), seq_(seq), seed_(seed) {}
  Batch rows_at(const std::vector<int64_t>& offsets) const;

  std::shared_ptr<const TokenFile> tokens_;
  int64_t seq_;
  uint64_t seed_;
};

}  // namespace foldpar
