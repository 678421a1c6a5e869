// What TSP generation's two decoders share (tsp/ only): the whole-model TspDecoder
// (tsp_decoder.cc) and a pipeline stage's (tsp_stage_decoder.cc, parallel/stage_decoder.h).
// The placement of tokens on the sequence-sharded cache, the prefill's padded rows and the
// sequence-sharded decode attention live in tsp_decoder.cc; these are their entry points.
// Nothing here communicates unless it says so.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "parallel/decode_block.h"
#include "parallel/sequence_shard.h"

namespace foldpar::tsp_detail {

// Where the tokens of every sequence lie on the D ranks: lengths [B] (tokens so far) and
// counts [B][D] (tokens of sequence b on rank r). Identical on every rank (and every stage).
struct TspPlacement {
  std::vector<int64_t> lengths;
  std::vector<std::vector<int64_t>> counts;
};

// The prefill's sequence length: the longest prompt padded to a multiple of 2D (zigzag) or D.
int64_t padded_prompt_length(const std::vector<std::vector<int32_t>>& prompts, int D, SeqSplit split);
// The placement after a prefill of `prompts` padded to S (padding rows are not kept).
TspPlacement place_prompts(const std::vector<std::vector<int32_t>>& prompts, int64_t S, int D, SeqSplit split);
// The cache slots rank `rank` needs per sequence after max_new more tokens (the most over
// the sequences, at least 1).
int64_t cache_capacity(const TspPlacement& placement, int64_t max_new, int rank);
// One decode step: each sequence's new token goes to its rank (counts updated, not lengths);
// positions[b] its position, slots[b] its slot in `cache` when this rank keeps it, else -1.
void place_new_tokens(Backend& be, int rank, TspPlacement& placement, KvCache& cache, std::vector<int64_t>& slots,
                      std::vector<int32_t>& positions);
// The prompts padded with token 0 as this rank's ids i32 [B, S/D].
Tensor prefill_ids(Backend& be, const std::vector<std::vector<int32_t>>& prompts, const SequenceShard& shard);
// Each prompt's last hidden state [B, h] on every rank from x [B*S/D, h]: one all_reduce over comm.
Tensor last_prompt_rows(Backend& be, const Tensor& x, const SequenceShard& shard, const std::vector<int64_t>& lengths,
                        TpComm& comm);
// The attention of one new token per sequence over the sequence-sharded `cache` (whose
// sequences are those of slots and positions, [B] each). Borrows everything; collective over comm.
std::unique_ptr<DecodeAttention> make_decode_attention(const ShardDims& dims, Backend& be, TpComm& comm,
                                                       KvCache& cache, const std::vector<int64_t>& slots,
                                                       const std::vector<int32_t>& positions);

}  // namespace foldpar::tsp_detail
