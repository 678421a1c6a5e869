// TSP as a pipeline stage's generation strategy (parallel/stage_decoder.h): the pieces of
// TspDecoder (tsp_decoder.cc, tsp_decode.h) over one stage's layers. Prefill is the TSP
// forward of the stage's layers (TspModel::prefill_stage) over a group of sequences, leaving
// their cache sharded by sequence; decode runs decode_block.h's layers over a group of sequences with the
// sequence-sharded attention on that group's view of the cache. The placement of new tokens
// is computed on every stage from the same counts, so the stages agree without a message.
#include <optional>

#include "parallel/stage_decoder.h"
#include "parallel/strategies.h"
#include "parallel/tsp/tsp_decode.h"
#include "parallel/tsp/tsp_model.h"

namespace foldpar {
namespace {

class TspStageDecoder final : public StageDecoder {
 public:
  TspStageDecoder(const LlamaConfig& config, Communicator& tsp, const Layout& layout, const StageLayers& layers)
      : config_(config),
        dims_(shard_dims(config, tsp.size())),
        comm_(tsp),
        layout_(layout),
        layers_(layers),
        end_(layers.end < 0 ? config.num_hidden_layers : layers.end),
        weights_(ShardedWeights::allocate(config, dims_, tsp.rank(), DType::kF32, MemCategory::kParameters, layers)) {}

  const StageLayers& layers() const override { return layers_; }
  Communicator& weight_axis() override { return comm_; }
  std::vector<ParamRef> parameters() override { return sharded_weight_refs(weights_, comm_.rank() == 0); }
  void init_weights(const InitOptions& o) override { init_sharded_weights(o, weights_); }

  Result<int64_t> start_prefill(Backend& be, const std::vector<std::vector<int32_t>>& prompts, int64_t max_new) override {
    const int D = comm_.size(), r = comm_.rank();
    const int64_t S = tsp_detail::padded_prompt_length(prompts, D, layout_.split);
    FP_ASSIGN_OR_RETURN(TspModel model, TspModel::create(config_, layout_, r, S));
    model_.emplace(std::move(model));
    placement_ = tsp_detail::place_prompts(prompts, S, D, layout_.split);
    const int64_t B = static_cast<int64_t>(prompts.size());
    cache_ = KvCache();
    cache_ = KvCache::allocate(end_ - layers_.first, B, tsp_detail::cache_capacity(placement_, max_new, r),
                               config_.num_key_value_heads, dims_.d, layers_.first);
    cache_.set_window(config_.sliding_window);
    cache_.keep_prefill_rows(be, model_->shard().positions(), placement_.lengths);
    ids_ = tsp_detail::prefill_ids(be, prompts, model_->shard());
    return model_->shard().local_seq();
  }

  // Every group runs at the batch's padded length S, so the rows the cache keeps
  // (keep_prefill_rows above, over every sequence) are the group's view's.
  Tensor prefill(Backend& be, int64_t b0, int64_t b1, Tensor x) override {
    FP_CHECK(model_.has_value(), "TSP stage prefill before start_prefill");
    KvCache group = cache_.sequences(b0, b1);
    Result<Tensor> y =
        model_->prefill_stage(be, comm_, weights_, ids_.narrow(b0, b1), layers_, std::move(x), group, &blocked_);
    FP_CHECK_OK(y.status());  // the ids are this decoder's own: [b1 - b0, S/D]
    return std::move(y).value();
  }

  Tensor prefill_logits(Backend& be, int64_t b0, int64_t b1, const Tensor& x) override {
    TpComm comm(comm_, be, layout_.overlap);
    const std::vector<int64_t> lengths(placement_.lengths.begin() + b0, placement_.lengths.begin() + b1);
    const Tensor rows = tsp_detail::last_prompt_rows(be, x, model_->shard(), lengths, comm);
    const DecodeContext ctx{&config_, &dims_, &be, &comm};
    Tensor logits = foldpar::decode_logits(ctx, weights_, rows);
    blocked_ += comm.blocked_seconds();
    return logits;
  }

  void start_decode(Backend& be) override {
    tsp_detail::place_new_tokens(be, comm_.rank(), placement_, cache_, slots_, positions_);
  }

  Tensor decode_embed(Backend& be, std::span<const int32_t> tokens) override {
    TpComm comm(comm_, be, layout_.overlap);
    const DecodeContext ctx{&config_, &dims_, &be, &comm};
    Tensor x = foldpar::decode_embed(ctx, weights_, tokens);
    blocked_ += comm.blocked_seconds();
    return x;
  }

  Tensor decode_layers(Backend& be, int64_t b0, int64_t b1, Tensor x) override {
    KvCache group = cache_.sequences(b0, b1);  // after start_decode's appends
    const std::vector<int64_t> slots(slots_.begin() + b0, slots_.begin() + b1);
    const std::vector<int32_t> positions(positions_.begin() + b0, positions_.begin() + b1);
    TpComm comm(comm_, be, layout_.overlap);
    std::unique_ptr<DecodeAttention> attention =
        tsp_detail::make_decode_attention(dims_, be, comm, group, slots, positions);
    const DecodeContext ctx{&config_, &dims_, &be, &comm};
    x = foldpar::decode_layers(ctx, weights_, layers_.first, end_, std::move(x), positions, *attention);
    blocked_ += comm.blocked_seconds();
    return x;
  }

  Tensor decode_logits(Backend& be, const Tensor& x) override {
    TpComm comm(comm_, be, layout_.overlap);
    const DecodeContext ctx{&config_, &dims_, &be, &comm};
    Tensor logits = foldpar::decode_logits(ctx, weights_, x);
    blocked_ += comm.blocked_seconds();
    return logits;
  }

  void finish_decode() override {
    for (int64_t& n : placement_.lengths) ++n;
  }

  const KvCache& cache() const override { return cache_; }
  double blocked_seconds() const override { return blocked_; }

 private:
  LlamaConfig config_;
  ShardDims dims_;
  Communicator& comm_;
  Layout layout_;  // split, overlap and head_buckets apply to prefill
  StageLayers layers_;
  int64_t end_;  // layers_.end resolved
  ShardedWeights weights_;
  std::optional<TspModel> model_;  // the prefill's (its sequence shard)
  Tensor ids_;                     // i32 [B, S/D]: this rank's prompt rows
  tsp_detail::TspPlacement placement_;
  KvCache cache_;                  // this stage's layers
  std::vector<int64_t> slots_;     // this decode step, per sequence
  std::vector<int32_t> positions_;
  double blocked_ = 0;
};

}  // namespace

Result<std::unique_ptr<StageDecoder>> make_tsp_stage_decoder(const LlamaConfig& config, Communicator& tsp,
                                                             const Layout& layout, const StageLayers& layers) {
  FP_CHECK(layout.strategy == Strategy::kTsp && layout.tsp == tsp.size(), "TSP stage decoder for layout {} over {} ranks",
           layout.to_string(), tsp.size());
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, 0));
  return std::unique_ptr<StageDecoder>(std::make_unique<TspStageDecoder>(config, tsp, layout, layers));
}

}  // namespace foldpar
