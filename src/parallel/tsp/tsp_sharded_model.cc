// TSP behind the ShardedModel interface: WeightShardedModel owns the shards (the storage
// dtype of the layout) and their gradients; TSP adds its step over the tsp communicator.
#include "parallel/strategies.h"
#include "parallel/tsp/tsp_model.h"

#include <fmt/format.h>

namespace foldpar {
namespace {

class TspShardedModel final : public WeightShardedModel {
 public:
  // Norm gains are replicated over the axis: rank 0 speaks for them.
  TspShardedModel(TspModel model, Communicator& comm)
      : WeightShardedModel(model.config(), model.dims(), comm, fmt::format("tsp={}", comm.size()),
                           model.options().dtype, Counting{comm.rank() == 0, true}),
        model_(std::move(model)),
        comm_(comm) {}

  Batch local_batch(const Batch& global) const override { return model_.shard().local_batch(global); }
  Result<StepResult> forward_backward(Backend& be, const Batch& local, int64_t loss_normalizer) override {
    return model_.forward_backward(be, comm_, weights_, local, grads_.views(), loss_normalizer);
  }
  Result<StepResult> forward(Backend& be, const Batch& local) override {
    return model_.forward(be, comm_, weights_, local);
  }
  Status assemble_logits(const Tensor& local, Tensor& global) override {
    return model_.assemble_logits(comm_, local, global);
  }

 private:
  TspModel model_;
  Communicator& comm_;
};

}  // namespace

Result<std::unique_ptr<ShardedModel>> make_tsp_sharded_model(const LlamaConfig& config, Communicator& tsp,
                                                             int64_t seq, const Layout& o) {
  FP_ASSIGN_OR_RETURN(TspModel model, TspModel::create(config, o, tsp.rank(), seq));
  return std::unique_ptr<ShardedModel>(std::make_unique<TspShardedModel>(std::move(model), tsp));
}

}  // namespace foldpar
