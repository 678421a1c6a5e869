// Tensor-parallel generation (tp=N), the baseline TSP's decode is measured against: prefill
// is the Megatron forward with one sp rank and no sequence parallelism, which leaves the KV cache sharded by heads (each rank: every token, its
// own KV heads); decode (parallel/decode_block.h) appends the new token's K/V of this rank's
// heads to its own cache and attends locally, so attention moves nothing.
// Traffic per decode step per rank, elements, tp ranks, when tp divides B*h: all_reduce
// (1 + 2L) x 2 B h (tp-1)/tp and the logits' all_gather B V (tp-1)/tp; nothing else.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include "comm/self_communicator.h"
#include "parallel/decode_block.h"
#include "parallel/megatron/megatron_model.h"
#include "parallel/sharded_decoder.h"
#include "parallel/stage_decoder.h"
#include "parallel/strategies.h"

namespace foldpar {
namespace {

// This rank's heads over every token of each sequence, all in the local cache.
class TpDecodeAttention final : public DecodeAttention {
 public:
  TpDecodeAttention(const ShardDims& dims, Backend& be, KvCache& cache, const std::vector<int64_t>& slots,
                    const std::vector<int32_t>& positions)
      : dm_(dims), be_(be), cache_(cache), slots_(slots), positions_(positions) {}

  void attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& attn) override {
    const int64_t B = q.dim(0), hs = dm_.heads, d = dm_.d;
    Tensor lse = Tensor::empty({hs}, DType::kF32, MemCategory::kActivations);
    for (int64_t b = 0; b < B; ++b) {
      cache_.store_token(be_, layer, b, slots_[static_cast<size_t>(b)], 0, k.narrow(b, b + 1), v.narrow(b, b + 1));
      Tensor out = attn.narrow(b, b + 1).reshape({hs, d});
      attend_cached(be_, cache_, layer, b, positions_[static_cast<size_t>(b)], q.narrow(b, b + 1).reshape({hs, d}), out,
                    lse);
    }
  }

 private:
  const ShardDims& dm_;
  Backend& be_;
  KvCache& cache_;
  const std::vector<int64_t>& slots_;
  const std::vector<int32_t>& positions_;
};

class TpDecoder final : public WeightShardedDecoder {
 public:
  TpDecoder(const LlamaConfig& config, ShardDims dims, Communicator& comm, bool overlap)
      : WeightShardedDecoder(config, dims, comm, fmt::format("tp={}", comm.size())),
        overlap_(overlap),
        sp_("sp", comm.world_ranks()[static_cast<size_t>(comm.rank())]) {}


  Result<Tensor> prefill(Backend& be, const std::vector<std::vector<int32_t>>& prompts, int64_t max_new) override;
  Result<Tensor> decode(Backend& be, std::span<const int32_t> tokens) override;

 private:
  bool overlap_;
  SelfCommunicator sp_;  // prefill's sequence axis: this rank alone
};

Result<Tensor> TpDecoder::prefill(Backend& be, const std::vector<std::vector<int32_t>>& prompts, int64_t max_new) {
  FP_RETURN_IF_ERROR(validate_prompts(config_, prompts, max_new));
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t B = static_cast<int64_t>(prompts.size()), h = dims_.h;
  int64_t S = 0;
  for (const auto& p : prompts) S = std::max(S, static_cast<int64_t>(p.size()));
  Layout o;  // tp=N: prefill runs plain tensor parallelism
  o.strategy = Strategy::kMegatron;
  o.tp = comm_.size();
  o.overlap = overlap_;
  FP_ASSIGN_OR_RETURN(MegatronModel model, MegatronModel::create(config_, o, comm_.rank(), 0, S, /*for_prefill=*/true));
  // Shorter prompts are padded after their end (token 0), which causal attention never shows them.
  std::vector<int32_t> host_ids(static_cast<size_t>(B * S), 0);
  lengths_.assign(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int32_t>& p = prompts[static_cast<size_t>(b)];
    std::copy(p.begin(), p.end(), host_ids.begin() + b * S);
    lengths_[static_cast<size_t>(b)] = static_cast<int64_t>(p.size());
  }
  Tensor ids = Tensor::empty({B, S}, DType::kI32, MemCategory::kActivations);
  be.copy_from_host(std::as_bytes(std::span<const int32_t>(host_ids)), ids);
  std::vector<int32_t> rows(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) rows[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  cache_ = KvCache();
  cache_ = KvCache::allocate(config_.num_hidden_layers, B, *std::max_element(lengths_.begin(), lengths_.end()) + max_new,
                             dims_.kv_heads, dims_.d);
  cache_.set_window(config_.sliding_window);
  cache_.keep_prefill_rows(be, rows, lengths_);
  decoded_ = 0;
  max_new_ = max_new;

  TpComm comm(comm_, be, overlap_);
  FP_ASSIGN_OR_RETURN(Tensor x, model.prefill(be, MegatronAxes{&comm_, &sp_}, weights_, ids, cache_, &times_.prefill_comm_seconds));
  // Every rank holds every token: each prompt's last row is at hand.
  Tensor last = Tensor::empty({B, h}, DType::kF32, MemCategory::kActivations);
  for (int64_t b = 0; b < B; ++b)
    be.copy_strided(x, last, {1, h, {(b * S + lengths_[static_cast<size_t>(b)] - 1) * h, h}, {b * h, h}});
  x = Tensor();
  const DecodeContext ctx{&config_, &dims_, &be, &comm};
  Tensor logits = decode_logits(ctx, weights_, last);
  times_.prefill_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  times_.prefill_comm_seconds += comm.blocked_seconds();
  return logits;
}

Result<Tensor> TpDecoder::decode(Backend& be, std::span<const int32_t> tokens) {
  const int64_t B = static_cast<int64_t>(lengths_.size());
  FP_RETURN_IF_ERROR(validate_decode_tokens(config_, tokens, B, decoded_, max_new_));
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int64_t> slots(static_cast<size_t>(B));
  std::vector<int32_t> positions(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    positions[static_cast<size_t>(b)] = static_cast<int32_t>(lengths_[static_cast<size_t>(b)]);
    slots[static_cast<size_t>(b)] = cache_.append(be, b, positions[static_cast<size_t>(b)]);
  }
  TpComm comm(comm_, be, overlap_);
  TpDecodeAttention attention(dims_, be, cache_, slots, positions);
  return finish_decode(be, comm, tokens, positions, attention, t0);
}

// tp as a pipeline stage's generation strategy (parallel/stage_decoder.h): TpDecoder's
// pieces over one stage's layers. Prefill is MegatronModel::prefill_stage over a group of
// sequences at the batch's padded length S (every tp rank holds every token, so what crosses
// to the next stage is each rank's own copy of the group's [n S, h]); decode runs
// decode_block.h's layers over the group with TpDecodeAttention on the group's view of the
// cache, sharded by heads as TpDecoder's.
class TpStageDecoder final : public StageDecoder {
 public:
  TpStageDecoder(const LlamaConfig& config, Communicator& tp, const Layout& layout, const StageLayers& layers)
      : config_(config),
        dims_(shard_dims(config, tp.size())),
        comm_(tp),
        overlap_(layout.overlap),
        layers_(layers),
        end_(layers.end < 0 ? config.num_hidden_layers : layers.end),
        weights_(ShardedWeights::allocate(config, dims_, tp.rank(), DType::kF32, MemCategory::kParameters, layers)),
        sp_("sp", tp.world_ranks()[static_cast<size_t>(tp.rank())]) {}

  const StageLayers& layers() const override { return layers_; }
  Communicator& weight_axis() override { return comm_; }
  std::vector<ParamRef> parameters() override { return sharded_weight_refs(weights_, comm_.rank() == 0); }
  void init_weights(const InitOptions& o) override { init_sharded_weights(o, weights_); }

  Result<int64_t> start_prefill(Backend& be, const std::vector<std::vector<int32_t>>& prompts, int64_t max_new) override {
    const int64_t B = static_cast<int64_t>(prompts.size());
    int64_t S = 0;
    for (const auto& p : prompts) S = std::max(S, static_cast<int64_t>(p.size()));
    Layout o;  // plain tensor parallelism, as TpDecoder's prefill
    o.strategy = Strategy::kMegatron;
    o.tp = comm_.size();
    o.overlap = overlap_;
    FP_ASSIGN_OR_RETURN(MegatronModel model,
                        MegatronModel::create(config_, o, comm_.rank(), 0, S, /*for_prefill=*/true));
    model_.emplace(std::move(model));
    // Shorter prompts are padded after their end (token 0), which causal attention never shows them.
    std::vector<int32_t> host_ids(static_cast<size_t>(B * S), 0);
    lengths_.assign(static_cast<size_t>(B), 0);
    for (int64_t b = 0; b < B; ++b) {
      const std::vector<int32_t>& p = prompts[static_cast<size_t>(b)];
      std::copy(p.begin(), p.end(), host_ids.begin() + b * S);
      lengths_[static_cast<size_t>(b)] = static_cast<int64_t>(p.size());
    }
    ids_ = Tensor::empty({B, S}, DType::kI32, MemCategory::kActivations);
    be.copy_from_host(std::as_bytes(std::span<const int32_t>(host_ids)), ids_);
    std::vector<int32_t> rows(static_cast<size_t>(S));
    for (int64_t i = 0; i < S; ++i) rows[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    cache_ = KvCache();
    cache_ = KvCache::allocate(end_ - layers_.first, B, *std::max_element(lengths_.begin(), lengths_.end()) + max_new,
                               dims_.kv_heads, dims_.d, layers_.first);
    cache_.set_window(config_.sliding_window);
    cache_.keep_prefill_rows(be, rows, lengths_);
    return S;
  }

  Tensor prefill(Backend& be, int64_t b0, int64_t b1, Tensor x) override {
    FP_CHECK(model_.has_value(), "tp stage prefill before start_prefill");
    KvCache group = cache_.sequences(b0, b1);
    Result<Tensor> y = model_->prefill_stage(be, MegatronAxes{&comm_, &sp_}, weights_, ids_.narrow(b0, b1), layers_,
                                             std::move(x), group, &blocked_);
    FP_CHECK_OK(y.status());  // the ids are this decoder's own: [b1 - b0, S]
    return std::move(y).value();
  }

  Tensor prefill_logits(Backend& be, int64_t b0, int64_t b1, const Tensor& x) override {
    // Every rank holds every token: each prompt's last row is at hand.
    const int64_t n = b1 - b0, S = ids_.dim(1), h = dims_.h;
    Tensor last = Tensor::empty({n, h}, DType::kF32, MemCategory::kActivations);
    for (int64_t b = 0; b < n; ++b)
      be.copy_strided(x, last, {1, h, {(b * S + lengths_[static_cast<size_t>(b0 + b)] - 1) * h, h}, {b * h, h}});
    return decode_logits(be, last);
  }

  void start_decode(Backend& be) override {
    const int64_t B = static_cast<int64_t>(lengths_.size());
    slots_.assign(static_cast<size_t>(B), 0);
    positions_.assign(static_cast<size_t>(B), 0);
    for (int64_t b = 0; b < B; ++b) {
      positions_[static_cast<size_t>(b)] = static_cast<int32_t>(lengths_[static_cast<size_t>(b)]);
      slots_[static_cast<size_t>(b)] = cache_.append(be, b, positions_[static_cast<size_t>(b)]);
    }
  }

  Tensor decode_embed(Backend& be, std::span<const int32_t> tokens) override {
    TpComm comm(comm_, be, overlap_);
    const DecodeContext ctx{&config_, &dims_, &be, &comm};
    Tensor x = foldpar::decode_embed(ctx, weights_, tokens);
    blocked_ += comm.blocked_seconds();
    return x;
  }

  Tensor decode_layers(Backend& be, int64_t b0, int64_t b1, Tensor x) override {
    KvCache group = cache_.sequences(b0, b1);  // after start_decode's appends
    const std::vector<int64_t> slots(slots_.begin() + b0, slots_.begin() + b1);
    const std::vector<int32_t> positions(positions_.begin() + b0, positions_.begin() + b1);
    TpComm comm(comm_, be, overlap_);
    TpDecodeAttention attention(dims_, be, group, slots, positions);
    const DecodeContext ctx{&config_, &dims_, &be, &comm};
    x = foldpar::decode_layers(ctx, weights_, layers_.first, end_, std::move(x), positions, attention);
    blocked_ += comm.blocked_seconds();
    return x;
  }

  Tensor decode_logits(Backend& be, const Tensor& x) override {
    TpComm comm(comm_, be, overlap_);
    const DecodeContext ctx{&config_, &dims_, &be, &comm};
    Tensor logits = foldpar::decode_logits(ctx, weights_, x);
    blocked_ += comm.blocked_seconds();
    return logits;
  }

  void finish_decode() override {
    for (int64_t& n : lengths_) ++n;
  }

  const KvCache& cache() const override { return cache_; }
  double blocked_seconds() const override { return blocked_; }

 private:
  LlamaConfig config_;
  ShardDims dims_;
  Communicator& comm_;
  bool overlap_;
  StageLayers layers_;
  int64_t end_;  // layers_.end resolved
  ShardedWeights weights_;
  SelfCommunicator sp_;                 // prefill's sequence axis: this rank alone
  std::optional<MegatronModel> model_;  // the prefill's (its S)
  Tensor ids_;                          // i32 [B, S]: the padded prompts
  std::vector<int64_t> lengths_;        // [B]: tokens so far
  KvCache cache_;                       // this stage's layers, this rank's KV heads
  std::vector<int64_t> slots_;          // this decode step, per sequence
  std::vector<int32_t> positions_;
  double blocked_ = 0;
};

}  // namespace

Result<std::unique_ptr<StageDecoder>> make_tp_stage_decoder(const LlamaConfig& config, Communicator& tp,
                                                            const Layout& layout, const StageLayers& layers) {
  FP_CHECK(layout.strategy == Strategy::kMegatron && layout.tp == tp.size() && layout.sp == 1,
           "tp stage decoder for layout {} over {} ranks", layout.to_string(), tp.size());
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, 0));
  return std::unique_ptr<StageDecoder>(std::make_unique<TpStageDecoder>(config, tp, layout, layers));
}

Result<std::unique_ptr<ShardedDecoder>> make_tp_decoder(const LlamaConfig& config, Communicator& tp,
                                                        const Layout& o) {
  FP_CHECK(o.strategy == Strategy::kMegatron && o.tp == tp.size() && o.sp == 1,
           "TP decoder for layout {} over {} ranks", o.to_string(), tp.size());
  FP_RETURN_IF_ERROR(validate_layout(config, o, 0, 0));
  // tp:seqpar decodes as tp: sequence parallelism shards the activations between tp's
  // collectives, a decode step's one token per sequence has nothing to shard, and the prefill
  // runs plain tp (its own layout above) over the same weight shards.
  return std::unique_ptr<ShardedDecoder>(std::make_unique<TpDecoder>(config, shard_dims(config, tp.size()), tp, o.overlap));
}

}  // namespace foldpar
