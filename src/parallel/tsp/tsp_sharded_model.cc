// TSP behind the ShardedModel interface.
#include "parallel/strategies.h"
#include "parallel/tsp/tsp_model.h"

#include <fmt/format.h>

namespace foldpar {
namespace {

class TspShardedModel final : public ShardedModel {
 public:
  TspShardedModel(TspModel model, Communicator& comm)
      : model_(std::move(model)),
        comm_(comm),
        layout_(fmt::format("tsp={}", comm.size())),
        weights_(ShardedWeights::allocate(model_.config(), model_.dims(), comm.rank(), model_.options().dtype,
                                          MemCategory::kParameters)),
        grads_(ShardedWeights::allocate(model_.config(), model_.dims(), comm.rank(), DType::kF32,
                                        MemCategory::kGradients)) {
    grads_.zero();
  }

  const std::string& layout() const override { return layout_; }
  Batch local_batch(const Batch& global) const override { return model_.shard().local_batch(global); }
  void init_weights(const InitOptions& o) override { init_sharded_weights(o, weights_); }
  void zero_grads() override { grads_.zero(); }
  Result<StepResult> forward_backward(Backend& be, const Batch& local, int64_t loss_normalizer) override {
    return model_.forward_backward(be, comm_, weights_, local, grads_, loss_normalizer);
  }
  // Norm gains are replicated over the axis: rank 0 speaks for them.
  std::vector<ParamRef> parameters() override { return sharded_param_refs(weights_, grads_, comm_.rank() == 0); }
  Result<StepResult> forward(Backend& be, const Batch& local) override {
    return model_.forward(be, comm_, weights_, local);
  }
  Status assemble_weights(LlamaWeights& global) override { return assemble_global(weights_, comm_, global); }
  Status assemble_grads(LlamaWeights& global) override { return assemble_global(grads_, comm_, global); }
  Status assemble_logits(const Tensor& local, Tensor& global) override {
    global.zero();
    model_.shard().scatter_to_global(local, global);
    return comm_.all_reduce(global.raw_data(), global.raw_data(), static_cast<size_t>(global.numel()), DType::kF32,
                            ReduceOp::kSum);
  }

 private:
  TspModel model_;
  Communicator& comm_;
  std::string layout_;
  ShardedWeights weights_;
  ShardedWeights grads_;
};

}  // namespace

Result<std::unique_ptr<ShardedModel>> make_tsp_sharded_model(const LlamaConfig& config, Communicator& tsp,
                                                             int64_t seq, const Layout& o) {
  FP_ASSIGN_OR_RETURN(TspModel model, TspModel::create(config, o, tsp.rank(), seq));
  return std::unique_ptr<ShardedModel>(std::make_unique<TspShardedModel>(std::move(model), tsp));
}

}  // namespace foldpar
