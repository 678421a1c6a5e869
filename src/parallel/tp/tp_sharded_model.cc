// Megatron tensor parallelism behind the ShardedModel interface.
#include <fmt/format.h>

#include "parallel/strategies.h"
#include "parallel/tp/tp_model.h"

namespace foldpar {
namespace {

class TpShardedModel final : public ShardedModel {
 public:
  TpShardedModel(TpModel model, Communicator& comm)
      : model_(std::move(model)),
        comm_(comm),
        layout_(fmt::format("tp={}", comm.size())),
        weights_(ShardedWeights::allocate(model_.config(), model_.dims(), comm.rank(), DType::kF32,
                                          MemCategory::kParameters)),
        grads_(ShardedWeights::allocate(model_.config(), model_.dims(), comm.rank(), DType::kF32,
                                        MemCategory::kGradients)) {
    grads_.zero();
  }

  const std::string& layout() const override { return layout_; }
  Batch local_batch(const Batch& global) const override { return model_.local_batch(global); }
  void init_weights(const InitOptions& o) override { init_sharded_weights(o, weights_); }
  void zero_grads() override { grads_.zero(); }
  Result<StepResult> forward_backward(Backend& be, const Batch& local, int64_t loss_normalizer) override {
    return model_.forward_backward(be, comm_, weights_, local, grads_, loss_normalizer);
  }
  // Every rank holds the same norm gains (and their full gradient): rank 0 speaks for them.
  std::vector<ParamRef> parameters() override { return sharded_param_refs(weights_, grads_, comm_.rank() == 0); }
  Result<StepResult> forward(Backend& be, const Batch& local) override {
    return model_.forward(be, comm_, weights_, local);
  }
  // Norm gains come from rank 0: every rank holds their full gradient after a step (plain
  // TP computes it on every token; sequence parallelism all-reduces the partials).
  Status assemble_weights(LlamaWeights& global) override { return assemble_global(weights_, comm_, global); }
  Status assemble_grads(LlamaWeights& global) override { return assemble_global(grads_, comm_, global); }
  Status assemble_logits(const Tensor& local, Tensor& global) override {
    if (!model_.options().sequence_parallel) {
      // Every rank holds every row: rank 0's are the answer.
      if (comm_.rank() == 0) global.copy_from(local);
      return comm_.broadcast(global.raw_data(), static_cast<size_t>(global.numel()), DType::kF32, 0);
    }
    global.zero();
    model_.scatter_rows(local, global);
    return comm_.all_reduce(global.raw_data(), global.raw_data(), static_cast<size_t>(global.numel()), DType::kF32,
                            ReduceOp::kSum);
  }

 private:
  TpModel model_;
  Communicator& comm_;
  std::string layout_;
  ShardedWeights weights_;
  ShardedWeights grads_;
};

}  // namespace

Result<std::unique_ptr<ShardedModel>> make_tp_sharded_model(const LlamaConfig& config, Communicator& tp, int64_t seq,
                                                            const LayoutOptions& o) {
  if (o.dtype != DType::kF32)
    return unimplemented("this layout stores weights and activations in f32 only; bf16 storage runs under tsp");
  TpOptions t;
  t.sequence_parallel = o.sequence_parallel;
  t.overlap = o.overlap;
  t.recompute = o.recompute;
  t.keep_logits = o.keep_logits;
  FP_ASSIGN_OR_RETURN(TpModel model, TpModel::create(config, tp.size(), tp.rank(), seq, t));
  return std::unique_ptr<ShardedModel>(std::make_unique<TpShardedModel>(std::move(model), tp));
}

}  // namespace foldpar
