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
  // data_axis: the dp replicas a MoE model's routing statistics are summed over (null: none).
  // wide: the expert groups over dp replicas (Layout::ep = K D, K > 1; else empty): the
  // all-to-all runs over the group, assembly sums the experts over its K ranks of this tsp
  // rank, and the experts' gradients sum over the dp/K replicas holding them.
  TspShardedModel(TspModel model, Communicator& comm, Communicator* data_axis, ExpertDataAxes wide)
      : WeightShardedModel(model.config(), model.dims(), comm, fmt::format("tsp={}", comm.size()),
                           model.options().dtype, Counting{comm.rank() == 0, true}),
        model_(std::move(model)),
        comm_(comm),
        data_axis_(model_.config().moe.enabled() ? data_axis : nullptr),
        wide_(std::move(wide)) {
    if (wide_.group) {
      model_.set_expert_axes(comm, wide_.group.get(), wide_.data.get());
      set_expert_axis(wide_.group->rank(), wide_.across.get(), wide_.data.get());
    }
  }

  Batch local_batch(const Batch& global) const override { return model_.shard().local_batch(global); }
  std::vector<const Communicator*> communicators_beside_mesh() const override { return wide_.all(); }
  Result<StepResult> forward_backward(Backend& be, const Batch& local, int64_t loss_normalizer) override {
    FP_ASSIGN_OR_RETURN(StepResult r, model_.forward_backward(be, comm_, weights_, local, grads_.views(),
                                                              loss_normalizer, data_axis_));
    return with_aux_in_sum(std::move(r));
  }
  Result<StepResult> forward(Backend& be, const Batch& local) override {
    FP_ASSIGN_OR_RETURN(StepResult r, model_.forward(be, comm_, weights_, local, data_axis_));
    return with_aux_in_sum(std::move(r));
  }
  Status assemble_logits(const Tensor& local, Tensor& global) override {
    return model_.assemble_logits(comm_, local, global);
  }

 private:
  // loss_sum carries the MoE aux term, as the single-rank model's does (single_rank_model.cc):
  // under dp each replica adds coef * aux (the global batch's) * its own valid tokens, so the
  // trainer's sum over the replicas divided by the global count is the single-rank loss.
  StepResult with_aux_in_sum(StepResult r) const {
    const MoeConfig& moe = model_.config().moe;
    if (moe.enabled() && moe.output_router_logits)
      r.loss_sum += moe.router_aux_loss_coef * r.aux_loss * static_cast<double>(r.valid_tokens);
    return r;
  }

  TspModel model_;
  Communicator& comm_;
  Communicator* data_axis_;
  ExpertDataAxes wide_;
};

}  // namespace

Result<std::unique_ptr<ShardedModel>> make_tsp_sharded_model(const LlamaConfig& config, Communicator& tsp,
                                                             Communicator* dp, int64_t seq, const Layout& o,
                                                             ExpertDataAxes wide) {
  FP_ASSIGN_OR_RETURN(TspModel model, TspModel::create(config, o, tsp.rank(), seq));
  return std::unique_ptr<ShardedModel>(std::make_unique<TspShardedModel>(std::move(model), tsp, dp, std::move(wide)));
}

}  // namespace foldpar
