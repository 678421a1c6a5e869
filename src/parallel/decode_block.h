// One decode step with stationary weights (docs/tsp.md section 6), shared by the strategies whose
// weights are ShardedWeights (tsp/, tp/). Every rank holds the same B token rows (one new
// token per sequence, replicated: B*h values) and its own weight shards, which never move:
//   embedding  this rank's vocabulary rows, summed over the axis     fwd: all_reduce [B, h] (TP's g)
//   per layer  a1 = norm(x); q, k, v of this rank's heads (column-parallel); RoPE at each
//              sequence's position; attention of this rank's heads over the whole cached
//              sequence: the strategy's DecodeAttention (sequence-sharded cache under TSP,
//              head-sharded under TP)
//              x_mid = x + sum over the axis of attn Wo_r^T          fwd: all_reduce [B, h] (g)
//              x_out = x_mid + sum of (silu(a2 Wg_r^T) * (a2 Wu_r^T)) Wd_r^T, a2 = norm(x_mid)
//                                                                    fwd: all_reduce [B, h] (g)
//              (a MoE model's sparse layer: every rank routes the B rows with the replicated
//              router, runs its own E/D experts on the rows routed to them, weighted; the
//              shared expert, replicated, is added after the sum)  fwd: all_reduce [B, h] (g)
//   head       xf = norm(x); logits of this rank's vocabulary rows   fwd: all_gather -> [B, V]
// Forward only: the conjugates (identity for g, reduce_scatter for the all_gather) never run.
//
// Traffic per step per rank outside attention, elements (times 4 bytes), D ranks, when D
// divides B*h (comm/comm_stats.h convention): all_reduce (1 + 2L) x 2 B h (D-1)/D, all_gather
// B V (D-1)/D each way. No broadcast, reduce or point-to-point: no weight byte moves.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "model/llama_config.h"
#include "parallel/kv_cache.h"
#include "parallel/sharded_decoder.h"
#include "parallel/sharded_weights.h"
#include "parallel/tensor_parallel.h"

namespace foldpar {

// What a decoder over ShardedWeights holds whatever its attention (tsp/, tp/): the config
// and shard dims, this rank's weights (f32 parameters, no gradients), its KV cache, each
// sequence's length, the decode budget and the phase times; and the ShardedDecoder
// accessors over them. The strategies add prefill, decode and their placement state.
class DecodeAttention;

class WeightShardedDecoder : public ShardedDecoder {
 public:
  WeightShardedDecoder(const LlamaConfig& config, ShardDims dims, Communicator& comm, std::string layout)
      : config_(config),
        dims_(dims),
        comm_(comm),
        layout_(std::move(layout)),
        weights_(ShardedWeights::allocate(config, dims, comm.rank(), DType::kF32, MemCategory::kParameters)) {}

  const std::string& layout() const override { return layout_; }
  std::vector<ParamRef> parameters() override { return sharded_weight_refs(weights_, comm_.rank() == 0); }
  void init_weights(const InitOptions& o) override { init_sharded_weights(o, weights_); }
  int64_t sequence_length(int64_t b) const override { return lengths_.empty() ? 0 : lengths_[static_cast<size_t>(b)]; }
  const KvCache& cache() const override { return cache_; }
  DecoderTimes times() const override { return times_; }

 protected:
  // What every decode step ends with, whatever the attention: decode_step over this rank's
  // weights, every sequence one token longer, the step counted and its time (from t0) and
  // blocked communication added to the phase times. Collective over comm's communicator.
  Tensor finish_decode(Backend& be, TpComm& comm, std::span<const int32_t> tokens,
                       const std::vector<int32_t>& positions, DecodeAttention& attention,
                       std::chrono::steady_clock::time_point t0);

  LlamaConfig config_;
  ShardDims dims_;
  Communicator& comm_;
  std::string layout_;
  ShardedWeights weights_;
  KvCache cache_;
  std::vector<int64_t> lengths_;  // [B]: tokens so far
  int64_t decoded_ = 0, max_new_ = 0;
  DecoderTimes times_;
};

// The attention of one new token per sequence over a strategy's KV cache.
class DecodeAttention {
 public:
  virtual ~DecodeAttention() = default;
  // q: [B, heads, d] this rank's query heads (ShardDims::heads) after RoPE; k, v: [B, kv_heads, d]
  // this rank's KV heads of the new tokens (k after RoPE). attn (written): [B, heads * d], this
  // rank's heads attending over every cached token of each sequence, the new one included.
  // Collective over the axis when the strategy's attention communicates.
  virtual void attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& attn) = 0;
};

struct DecodeContext {
  const LlamaConfig* config = nullptr;
  const ShardDims* dims = nullptr;
  Backend* backend = nullptr;
  TpComm* comm = nullptr;  // over the layout's axis (tsp or tp): D ranks, this rank r
};

// ids: the B new tokens; positions: their global positions (each sequence its own). Returns
// f32 [B, V], the same on every rank. Collective over ctx.comm. It is decode_embed, then
// decode_layers over every layer, then decode_logits; a pipeline stage (parallel/pipeline/)
// runs the pieces of its own StageLayers.
Tensor decode_step(const DecodeContext& ctx, const ShardedWeights& w, std::span<const int32_t> ids,
                   std::span<const int32_t> positions, DecodeAttention& attention);
// The embedding alone: f32 [B, h], the same on every rank. Collective over ctx.comm (one all_reduce).
Tensor decode_embed(const DecodeContext& ctx, const ShardedWeights& w, std::span<const int32_t> ids);
// Layers [first, end) (global indices; w holds them) on x [B, h], the same on every rank;
// returns the last one's output [B, h]. Collective over ctx.comm.
Tensor decode_layers(const DecodeContext& ctx, const ShardedWeights& w, int64_t first, int64_t end, Tensor x,
                     std::span<const int32_t> positions, DecodeAttention& attention);

// Attention of one token of sequence b at `position` over the sequence's slots in `cache`,
// one Backend::attention_forward per KV head (the cache is head-major, so nothing is packed).
// q: [n, d], n = g x cache.kv_heads() query heads in head order (head i reads KV head i / g).
// out (written) [n, d], lse (written) [n]. Nothing cached: out 0, lse -inf. Not collective.
void attend_cached(Backend& backend, const KvCache& cache, int layer, int64_t b, int32_t position, const Tensor& q,
                   Tensor& out, Tensor& lse);

// The head alone (prefill ends with it): x [B, h], the same on every rank -> f32 [B, V].
// Collective over ctx.comm (one all_gather).
Tensor decode_logits(const DecodeContext& ctx, const ShardedWeights& w, const Tensor& x);

}  // namespace foldpar
