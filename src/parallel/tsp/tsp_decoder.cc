// TSP generation (docs/tsp.md section 6): prefill is the TSP forward, which leaves the KV cache
// sharded by sequence (each rank: its own tokens, every head); decode keeps the weights where
// they are (parallel/decode_block.h) and attends over the sequence-sharded cache:
//   q, k, v of this rank's heads  -> all_gather [B, q_rows + 2 kv_rows] per rank: every rank
//                                    gets every head's query; the rank that keeps the new
//                                    token stores its K/V (every head)
//                                    (KV replicas, n_kv < D: each rank's block carries its
//                                    replica's one KV head; every block of a group stores
//                                    the same values at that head)
//   partial attention of every head over this rank's cache slots, with its log-sum-exp
//   all_to_all: rank s receives every rank's (partial output, lse) of s's heads,
//                                    B * heads * (d + 1) values per peer
//   exact combine of the D partials in rank order (merge_attention_block), locally
// Only the combined output of a rank's OWN heads is needed (the output projection is
// row-parallel over heads), so an all_to_all delivers exactly that, at half the bytes of the
// all-reduce docs/tsp.md section 6 sketches and without a second collective for the max.
// Placement: the new token of sequence b goes to the rank holding the fewest of b's tokens,
// ties to the first such rank counting from b mod D; every rank runs the same rule on the
// same counts, so no message says where a token went. The cache stays balanced within one
// token per sequence once decode has caught up with any padding the prefill dropped.
//
// Traffic per decode step per rank, elements, D ranks, n_h = D*heads, when D divides B*h
// (decode_block.h gives the rest):
//   all_gather   L x B (h + 2h/g) (D-1)/D      all_to_all  L x B (h + n_h) (D-1)/D
//   all_reduce   (1 + 2L) x 2 B h (D-1)/D      all_gather  B V (D-1)/D (the logits)
// The placement, the prompt rows and the attention are also a pipeline stage's
// (tsp_stage_decoder.cc), through tsp_decode.h.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "parallel/decode_block.h"
#include "parallel/ring_attention.h"
#include "parallel/sharded_decoder.h"
#include "parallel/strategies.h"
#include "parallel/tsp/tsp_decode.h"
#include "parallel/tsp/tsp_model.h"

namespace foldpar {
namespace {

Tensor act(const Shape& shape) { return Tensor::empty(shape, DType::kF32, MemCategory::kActivations); }

// counts[r]: tokens of one sequence on rank r. The rank the next token goes to.
int pick_rank(const std::vector<int64_t>& counts, int64_t sequence) {
  const int D = static_cast<int>(counts.size());
  int best = static_cast<int>(sequence % D);
  for (int i = 1; i < D; ++i) {
    const int r = static_cast<int>((sequence + i) % D);
    if (counts[static_cast<size_t>(r)] < counts[static_cast<size_t>(best)]) best = r;
  }
  return best;
}

// Attention of the new tokens over the sequence-sharded cache.
class TspDecodeAttention final : public DecodeAttention {
 public:
  TspDecodeAttention(const ShardDims& dims, Backend& be, TpComm& comm, KvCache& cache, const std::vector<int64_t>& slots,
                     const std::vector<int32_t>& positions)
      : dm_(dims), be_(be), comm_(comm), cache_(cache), slots_(slots), positions_(positions) {}

  void attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& attn) override {
    const int64_t B = q.dim(0), n_h = dm_.heads * dm_.degree;
    Tensor q_all = act({B, n_h, dm_.d});
    gather_heads(layer, q, k, v, q_all);
    Tensor send = Tensor::empty({dm_.degree, B * dm_.heads * (dm_.d + 1)}, DType::kF32, MemCategory::kComm);
    for (int64_t b = 0; b < B; ++b) partial_attention(layer, b, q_all, send);
    combine(send, attn);
  }

 private:
  // Packs [q | k | v] of this rank's heads per sequence, all_gathers them, fills q_all
  // [B, n_h, d] and, for the sequences whose new token this rank keeps, its cache slot.
  void gather_heads(int layer, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& q_all) {
    const int64_t B = q.dim(0), qr = dm_.q_rows, kvr = dm_.kv_rows, row = qr + 2 * kvr, D = dm_.degree;
    Tensor packed = Tensor::empty({B, row}, DType::kF32, MemCategory::kComm);
    be_.copy_strided(q, packed, {B, qr, {0, qr}, {0, row}});
    be_.copy_strided(k, packed, {B, kvr, {0, kvr}, {qr, row}});
    be_.copy_strided(v, packed, {B, kvr, {0, kvr}, {qr + kvr, row}});
    Tensor all = Tensor::empty({D * B, row}, DType::kF32, MemCategory::kComm);
    const auto t0 = std::chrono::steady_clock::now();
    comm_.blocking(comm_.comm().all_gather(packed.raw_data(), all.raw_data(), static_cast<size_t>(B * row), DType::kF32),
                   t0);
    // Rank r's block holds heads [r*heads, (r+1)*heads): in head order they are consecutive.
    for (int64_t r = 0; r < D; ++r)
      for (int64_t b = 0; b < B; ++b) {
        const Tensor got = all.narrow(r * B + b, r * B + b + 1).reshape({row});
        be_.copy_strided(got, q_all, {1, qr, {0, qr}, {(b * D + r) * qr, qr}});
        const int64_t slot = slots_[static_cast<size_t>(b)];
        if (slot >= 0)
          cache_.store_token(be_, layer, b, slot, dm_.kv_head0(static_cast<int>(r)), got.narrow(qr, qr + kvr),
                             got.narrow(qr + kvr, row));
      }
  }

  // Every head of sequence b's new token over this rank's slots; the output and lse of the
  // heads of rank s go into send block s: [B * heads * d outputs | B * heads lse].
  void partial_attention(int layer, int64_t b, const Tensor& q_all, Tensor& send) {
    const int64_t B = q_all.dim(0), n_h = q_all.dim(1), d = dm_.d, hs = dm_.heads;
    Tensor out = act({n_h, d}), lse = act({n_h});
    attend_cached(be_, cache_, layer, b, positions_[static_cast<size_t>(b)], q_all.narrow(b, b + 1).reshape({n_h, d}),
                  out, lse);
    const int64_t block = B * hs * (d + 1);
    for (int64_t s = 0; s < dm_.degree; ++s) {
      be_.copy_strided(out, send, {1, hs * d, {s * hs * d, hs * d}, {s * block + b * hs * d, hs * d}});
      be_.copy_strided(lse, send, {1, hs, {s * hs, hs}, {s * block + B * hs * d + b * hs, hs}});
    }
  }

  // all_to_all, then the exact log-sum-exp combine of the D partials of this rank's heads.
  void combine(const Tensor& send, Tensor& attn) {
    const int64_t B = attn.dim(0), hs = dm_.heads, d = dm_.d, D = dm_.degree, block = B * hs * (d + 1);
    Tensor recv = Tensor::empty({D, block}, DType::kF32, MemCategory::kComm);
    const auto t0 = std::chrono::steady_clock::now();
    comm_.blocking(comm_.comm().all_to_all(send.raw_data(), recv.raw_data(), static_cast<size_t>(block), DType::kF32),
                   t0);
    // Block r: rank r's partial outputs [B, 1, hs, d] of this rank's heads, then their lse [B, hs, 1].
    auto out_of = [&](int64_t r) {
      return recv.narrow(r, r + 1).reshape({block}).narrow(0, B * hs * d).reshape({B, 1, hs, d});
    };
    auto lse_of = [&](int64_t r) {
      return recv.narrow(r, r + 1).reshape({block}).narrow(B * hs * d, block).reshape({B, hs, 1});
    };
    Tensor out = attn.reshape({B, 1, hs, d});
    be_.copy(out_of(0), out);
    Tensor lse = act({B, hs, 1});
    be_.copy(lse_of(0), lse);
    for (int64_t r = 1; r < D; ++r) merge_attention_block(be_, out_of(r), lse_of(r), out, lse);
  }

  const ShardDims& dm_;
  Backend& be_;
  TpComm& comm_;
  KvCache& cache_;
  const std::vector<int64_t>& slots_;       // per sequence: this step's slot on this rank, or -1
  const std::vector<int32_t>& positions_;  // per sequence: the new token's position
};

}  // namespace

namespace tsp_detail {

int64_t padded_prompt_length(const std::vector<std::vector<int32_t>>& prompts, int D, SeqSplit split) {
  int64_t longest = 0;
  for (const auto& pr : prompts) longest = std::max(longest, static_cast<int64_t>(pr.size()));
  const int64_t unit = split == SeqSplit::kZigzag ? 2 * D : D;
  return (longest + unit - 1) / unit * unit;
}

TspPlacement place_prompts(const std::vector<std::vector<int32_t>>& prompts, int64_t S, int D, SeqSplit split) {
  const size_t B = prompts.size();
  TspPlacement p;
  p.lengths.assign(B, 0);
  p.counts.assign(B, std::vector<int64_t>(static_cast<size_t>(D), 0));
  for (size_t b = 0; b < B; ++b) {
    p.lengths[b] = static_cast<int64_t>(prompts[b].size());
    for (int r = 0; r < D; ++r)
      for (int32_t pos : shard_positions(S, D, r, split)) p.counts[b][static_cast<size_t>(r)] += pos < p.lengths[b];
  }
  return p;
}

int64_t cache_capacity(const TspPlacement& placement, int64_t max_new, int rank) {
  int64_t capacity = 1;
  for (size_t b = 0; b < placement.counts.size(); ++b) {
    std::vector<int64_t> counts = placement.counts[b];
    for (int64_t t = 0; t < max_new; ++t) ++counts[static_cast<size_t>(pick_rank(counts, static_cast<int64_t>(b)))];
    capacity = std::max(capacity, counts[static_cast<size_t>(rank)]);
  }
  return capacity;
}

void place_new_tokens(Backend& be, int rank, TspPlacement& placement, KvCache& cache, std::vector<int64_t>& slots,
                      std::vector<int32_t>& positions) {
  const size_t B = placement.lengths.size();
  slots.assign(B, -1);
  positions.assign(B, 0);
  for (size_t i = 0; i < B; ++i) {
    positions[i] = static_cast<int32_t>(placement.lengths[i]);
    const int r = pick_rank(placement.counts[i], static_cast<int64_t>(i));
    ++placement.counts[i][static_cast<size_t>(r)];
    if (r == rank) slots[i] = cache.append(be, static_cast<int64_t>(i), positions[i]);
  }
}

Tensor prefill_ids(Backend& be, const std::vector<std::vector<int32_t>>& prompts, const SequenceShard& shard) {
  const int64_t B = static_cast<int64_t>(prompts.size());
  const std::vector<int32_t>& pos = shard.positions();
  const size_t n = pos.size();
  // This rank's rows of the prompts; padding: token 0, after the prompt, never seen by it (causal).
  std::vector<int32_t> host(static_cast<size_t>(B) * n, 0);
  for (size_t b = 0; b < prompts.size(); ++b)
    for (size_t i = 0; i < n; ++i)
      if (static_cast<size_t>(pos[i]) < prompts[b].size()) host[b * n + i] = prompts[b][static_cast<size_t>(pos[i])];
  Tensor ids = Tensor::empty({B, static_cast<int64_t>(n)}, DType::kI32, MemCategory::kActivations);
  be.copy_from_host(std::as_bytes(std::span<const int32_t>(host)), ids);
  return ids;
}

Tensor last_prompt_rows(Backend& be, const Tensor& x, const SequenceShard& shard, const std::vector<int64_t>& lengths,
                        TpComm& comm) {
  const int64_t B = static_cast<int64_t>(lengths.size()), h = x.dim(1), Sl = shard.local_seq();
  Tensor rows = Tensor::empty({B, h}, DType::kF32, MemCategory::kActivations);
  be.fill(0.0, rows);
  const std::vector<int32_t>& pos = shard.positions();
  for (int64_t b = 0; b < B; ++b) {
    const auto it = std::find(pos.begin(), pos.end(), static_cast<int32_t>(lengths[static_cast<size_t>(b)] - 1));
    if (it == pos.end()) continue;
    be.copy_strided(x, rows, {1, h, {(b * Sl + (it - pos.begin())) * h, h}, {b * h, h}});
  }
  comm.all_reduce(rows);  // one rank holds each row, the others add zeros: exact
  return rows;
}

std::unique_ptr<DecodeAttention> make_decode_attention(const ShardDims& dims, Backend& be, TpComm& comm,
                                                       KvCache& cache, const std::vector<int64_t>& slots,
                                                       const std::vector<int32_t>& positions) {
  return std::make_unique<TspDecodeAttention>(dims, be, comm, cache, slots, positions);
}

}  // namespace tsp_detail

namespace {

class TspDecoder final : public WeightShardedDecoder {
 public:
  TspDecoder(const LlamaConfig& config, ShardDims dims, Communicator& comm, const Layout& options)
      : WeightShardedDecoder(config, dims, comm, fmt::format("tsp={}", comm.size())), options_(options) {}

  Result<Tensor> prefill(Backend& be, const std::vector<std::vector<int32_t>>& prompts, int64_t max_new) override;
  Result<Tensor> decode(Backend& be, std::span<const int32_t> tokens) override;

 private:
  Layout options_;  // tsp=D: split, overlap and head_buckets apply to prefill
  std::vector<std::vector<int64_t>> counts_;  // [B][D]: tokens of sequence b on rank r
};

Result<Tensor> TspDecoder::prefill(Backend& be, const std::vector<std::vector<int32_t>>& prompts, int64_t max_new) {
  FP_RETURN_IF_ERROR(validate_prompts(config_, prompts, max_new));
  const auto t0 = std::chrono::steady_clock::now();
  const int D = comm_.size(), p = comm_.rank();
  const int64_t B = static_cast<int64_t>(prompts.size());
  const int64_t S = tsp_detail::padded_prompt_length(prompts, D, options_.split);
  FP_ASSIGN_OR_RETURN(TspModel model, TspModel::create(config_, options_, p, S));
  tsp_detail::TspPlacement placement = tsp_detail::place_prompts(prompts, S, D, options_.split);
  cache_ = KvCache();
  cache_ = KvCache::allocate(config_.num_hidden_layers, B, tsp_detail::cache_capacity(placement, max_new, p),
                             config_.num_key_value_heads, dims_.d);
  cache_.set_window(config_.sliding_window);
  cache_.keep_prefill_rows(be, model.shard().positions(), placement.lengths);
  lengths_ = std::move(placement.lengths);
  counts_ = std::move(placement.counts);
  decoded_ = 0;
  max_new_ = max_new;

  TpComm comm(comm_, be, options_.overlap);
  FP_ASSIGN_OR_RETURN(Tensor x, model.prefill(be, comm_, weights_, tsp_detail::prefill_ids(be, prompts, model.shard()),
                                                cache_, &times_.prefill_comm_seconds));
  const Tensor rows = tsp_detail::last_prompt_rows(be, x, model.shard(), lengths_, comm);
  x = Tensor();
  const DecodeContext ctx{&config_, &dims_, &be, &comm};
  Tensor logits = decode_logits(ctx, weights_, rows);
  times_.prefill_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  times_.prefill_comm_seconds += comm.blocked_seconds();
  return logits;
}

Result<Tensor> TspDecoder::decode(Backend& be, std::span<const int32_t> tokens) {
  const int64_t B = static_cast<int64_t>(lengths_.size());
  FP_RETURN_IF_ERROR(validate_decode_tokens(config_, tokens, B, decoded_, max_new_));
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int64_t> slots;
  std::vector<int32_t> positions;
  tsp_detail::TspPlacement placement{lengths_, std::move(counts_)};
  tsp_detail::place_new_tokens(be, comm_.rank(), placement, cache_, slots, positions);
  counts_ = std::move(placement.counts);
  TpComm comm(comm_, be, options_.overlap);
  TspDecodeAttention attention(dims_, be, comm, cache_, slots, positions);
  return finish_decode(be, comm, tokens, positions, attention, t0);
}

}  // namespace

Result<std::unique_ptr<ShardedDecoder>> make_tsp_decoder(const LlamaConfig& config, Communicator& tsp,
                                                         const Layout& o) {
  FP_CHECK(o.strategy == Strategy::kTsp && o.tsp == tsp.size(), "TSP decoder for layout {} over {} ranks",
           o.to_string(), tsp.size());
  FP_RETURN_IF_ERROR(validate_layout(config, o, 0, 0));
  return std::unique_ptr<ShardedDecoder>(std::make_unique<TspDecoder>(config, shard_dims(config, tsp.size()), tsp, o));
}

}  // namespace foldpar
