// TP x SP behind the ShardedModel interface: tp slices of the weights (replicated across sp)
// in ShardedWeights, their gradients in one flat TpspGrads buffer, sequence-sharded tokens.
#include <fmt/format.h>

#include "parallel/strategies.h"
#include "parallel/tpsp/tpsp_model.h"

namespace foldpar {
namespace {

class TpspShardedModel final : public ShardedModel {
 public:
  TpspShardedModel(TpspModel model, Communicator& tp, Communicator& sp)
      : model_(std::move(model)),
        tp_(tp),
        sp_(sp),
        layout_(fmt::format("tp={},sp={}", tp.size(), sp.size())),
        weights_(ShardedWeights::allocate(model_.config(), model_.dims(), tp.rank(), DType::kF32,
                                          MemCategory::kParameters)),
        grads_(TpspGrads::allocate(model_.config(), model_.dims(), tp.rank(), MemCategory::kGradients)) {
    grads_.zero();
  }

  const std::string& layout() const override { return layout_; }
  Batch local_batch(const Batch& global) const override { return model_.local_batch(global); }
  // Every sp rank generates the same tp slices: identical replicas across sp.
  void init_weights(const InitOptions& o) override { init_sharded_weights(o, weights_); }
  void zero_grads() override { grads_.zero(); }
  Result<StepResult> forward_backward(Backend& be, const Batch& local, int64_t loss_normalizer) override {
    return model_.forward_backward(be, TpspAxes{&tp_, &sp_}, weights_, local, grads_, loss_normalizer);
  }
  Result<StepResult> forward(Backend& be, const Batch& local) override {
    return model_.forward(be, TpspAxes{&tp_, &sp_}, weights_, local);
  }
  // The tp slices are replicated across sp: sp rank 0 speaks for them; the norm gains are
  // replicated on every rank: (tp 0, sp 0) speaks for them.
  std::vector<ParamRef> parameters() override {
    return sharded_param_refs(weights_, grads_.views(), tp_.rank() == 0 && sp_.rank() == 0, sp_.rank() == 0);
  }
  // Over tp only: every sp group holds the same slices (and, after a step, the same summed
  // gradients), so each group assembles the whole model on its own.
  Status assemble_weights(LlamaWeights& global) override { return assemble_global(weights_, tp_, global); }
  Status assemble_grads(LlamaWeights& global) override { return assemble_global(grads_.views(), tp_, global); }
  // Plain: the ranks of one sp communicator hold disjoint positions that cover the sequence
  // (the tp ranks of a group hold the same rows), so a sum over sp assembles the logits.
  // Sequence parallel: every rank's rows are its own; sum over tp, then over sp.
  Status assemble_logits(const Tensor& local, Tensor& global) override {
    global.zero();
    model_.scatter_rows(local, global);
    const size_t n = static_cast<size_t>(global.numel());
    if (model_.options().sequence_parallel)
      FP_RETURN_IF_ERROR(tp_.all_reduce(global.raw_data(), global.raw_data(), n, DType::kF32, ReduceOp::kSum));
    return sp_.all_reduce(global.raw_data(), global.raw_data(), n, DType::kF32, ReduceOp::kSum);
  }

 private:
  TpspModel model_;
  Communicator& tp_;
  Communicator& sp_;
  std::string layout_;
  ShardedWeights weights_;
  TpspGrads grads_;
};

}  // namespace

Result<std::unique_ptr<ShardedModel>> make_tpsp_sharded_model(const LlamaConfig& config, Communicator& tp,
                                                              Communicator& sp, int64_t seq, const LayoutOptions& o) {
  if (o.dtype != DType::kF32)
    return unimplemented("this layout stores weights and activations in f32 only; bf16 storage runs under tsp");
  TpspOptions t;
  t.split = o.split;
  t.kv_exchange = o.kv_exchange;
  t.sequence_parallel = o.sequence_parallel;
  t.overlap = o.overlap;
  t.recompute = o.recompute;
  t.keep_logits = o.keep_logits;
  FP_ASSIGN_OR_RETURN(TpspModel model, TpspModel::create(config, tp.size(), tp.rank(), sp.size(), sp.rank(), seq, t));
  return std::unique_ptr<ShardedModel>(std::make_unique<TpspShardedModel>(std::move(model), tp, sp));
}

}  // namespace foldpar
