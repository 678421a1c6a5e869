// SP behind the ShardedModel interface: replicated weights and gradients (every rank holds
// full tensors, so assembling them is a copy), sequence-sharded tokens and logits.
#include <fmt/format.h>

#include "parallel/sharded_weights.h"
#include "parallel/sp/sp_model.h"
#include "parallel/strategies.h"

namespace foldpar {
namespace {

Status copy_weights(const LlamaWeights& src, LlamaWeights& dst) {
  std::vector<const Tensor*> from;
  src.for_each([&](const std::string&, const Tensor& t) { from.push_back(&t); });
  size_t i = 0;
  Status status;
  dst.for_each([&](const std::string& name, Tensor& t) {
    if (!status.ok()) return;
    if (i >= from.size() || from[i]->shape() != t.shape() || from[i]->dtype() != t.dtype()) {
      status = invalid_argument("assemble: {} is {}, the model holds {}", name, t.describe(),
                                i < from.size() ? from[i]->describe() : std::string("nothing"));
      return;
    }
    t.copy_from(*from[i++]);
  });
  if (status.ok() && i != from.size())
    return invalid_argument("assemble: the destination has {} tensors, the model {}", i, from.size());
  return status;
}

class SpShardedModel final : public ShardedModel {
 public:
  SpShardedModel(SpModel model, Communicator& comm)
      : model_(std::move(model)),
        comm_(comm),
        layout_(fmt::format("sp={}", comm.size())),
        weights_(LlamaWeights::allocate(model_.config(), DType::kF32, MemCategory::kParameters)),
        grads_(SpGrads::allocate(model_.config(), MemCategory::kGradients)) {
    grads_.zero();
  }

  const std::string& layout() const override { return layout_; }
  Batch local_batch(const Batch& global) const override { return model_.shard().local_batch(global); }
  // Every rank generates the whole model from the same seed: identical replicas.
  void init_weights(const InitOptions& o) override { foldpar::init_weights(o, weights_); }
  void zero_grads() override { grads_.zero(); }
  Result<StepResult> forward_backward(Backend& be, const Batch& local, int64_t loss_normalizer) override {
    return model_.forward_backward(be, comm_, weights_, local, grads_, loss_normalizer);
  }
  // Every tensor is replicated over the axis: rank 0 speaks for all of them.
  std::vector<ParamRef> parameters() override {
    LlamaWeights g = grads_.views();
    return replicated_param_refs(weights_, g, comm_.rank() == 0);
  }
  Result<StepResult> forward(Backend& be, const Batch& local) override {
    return model_.forward(be, comm_, weights_, local);
  }
  // The gradients are already summed over the axis on every rank.
  Status assemble_weights(LlamaWeights& global) override { return copy_weights(weights_, global); }
  Status assemble_grads(LlamaWeights& global) override { return copy_weights(grads_.views(), global); }
  Status assemble_logits(const Tensor& local, Tensor& global) override {
    global.zero();
    model_.shard().scatter_to_global(local, global);
    return comm_.all_reduce(global.raw_data(), global.raw_data(), static_cast<size_t>(global.numel()), DType::kF32,
                            ReduceOp::kSum);
  }

 private:
  SpModel model_;
  Communicator& comm_;
  std::string layout_;
  LlamaWeights weights_;
  SpGrads grads_;
};

}  // namespace

Result<std::unique_ptr<ShardedModel>> make_sp_sharded_model(const LlamaConfig& config, Communicator& sp, int64_t seq,
                                                            const LayoutOptions& o) {
  if (o.dtype != DType::kF32)
    return unimplemented("this layout stores weights and activations in f32 only; bf16 storage runs under tsp");
  SpOptions s;
  s.split = o.split;
  s.kv_exchange = o.kv_exchange;
  s.overlap = o.overlap;
  s.recompute = o.recompute;
  s.keep_logits = o.keep_logits;
  FP_ASSIGN_OR_RETURN(SpModel model, SpModel::create(config, sp.size(), sp.rank(), seq, s));
  return std::unique_ptr<ShardedModel>(std::make_unique<SpShardedModel>(std::move(model), sp));
}

}  // namespace foldpar
