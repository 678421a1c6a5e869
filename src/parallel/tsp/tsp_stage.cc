// TSP as a pipeline stage (parallel/stage_strategy.h): one TspStep per pipeline step, shared
// by the micro-batches in flight (each its own TspModelStep and saved state), so the
// norm-gain partials of every micro-batch are summed over the axis once, after the last
// backward. The stage's weights are the pipeline's (ShardedWeights of its StageLayers).
#include "parallel/stage_strategy.h"
#include "parallel/strategies.h"
#include "parallel/tsp/tsp_step.h"

namespace foldpar {
namespace {

using tsp_detail::TspStep;

class TspStageSteps final : public StageSteps {
 public:
  TspStageSteps(const TspModel& model, Backend& be, Communicator& comm, Communicator* data_axis,
                const ShardedWeights& w, ShardedGrads* g, int64_t batch)
      : model_(model),
        be_(be),
        step_(model, be, comm, batch),
        data_axis_(data_axis),
        w_(w),
        g_(g != nullptr ? &g->views() : nullptr),
        batch_(batch) {}

  Result<std::unique_ptr<ModelStep>> micro_batch(const Batch& local, int64_t loss_normalizer) override {
    FP_RETURN_IF_ERROR(tsp_detail::check_local_batch(be_, model_, local));
    if (local.batch() != batch_)
      return invalid_argument("a micro-batch of {} sequences in a pipeline step of {}", local.batch(), batch_);
    return tsp_detail::make_model_step(step_, model_, w_, local, g_, loss_normalizer, data_axis_);
  }
  void finish_backward() override { step_.sum_norm_partials(*g_); }
  double wait_seconds() const override { return step_.wait_seconds(); }

 private:
  const TspModel& model_;
  Backend& be_;
  TspStep step_;
  Communicator* data_axis_;  // MoE: the replicas the last stage sums the routing statistics over
  const ShardedWeights& w_;
  ShardedWeights* g_;
  int64_t batch_;
};

class TspStageStrategy final : public StageStrategy {
 public:
  // data_axis: a MoE model's dp replicas (null otherwise or without dp). wide: this stage's
  // expert groups over dp replicas (Layout::ep = K D, K > 1; else empty), as
  // TspShardedModel's: the dispatch over the group, the routing statistics over it and its
  // expert-data replicas, assembly summing the experts over its K ranks of this tsp rank.
  TspStageStrategy(TspModel model, Communicator& comm, Communicator* data_axis, ExpertDataAxes wide)
      : model_(std::move(model)),
        comm_(comm),
        data_axis_(model_.config().moe.enabled() ? data_axis : nullptr),
        wide_(std::move(wide)) {
    if (wide_.group) {
      model_.set_expert_axes(comm, wide_.group.get(), wide_.data.get());
    }
  }

  Batch local_batch(const Batch& global) const override { return model_.shard().local_batch(global); }
  const ShardDims& dims() const override { return model_.dims(); }
  Communicator& weight_axis() override { return comm_; }
  bool counts_replicated() const override { return comm_.rank() == 0; }
  int expert_rank() const override { return wide_.group ? wide_.group->rank() : -1; }
  Communicator* expert_across() override { return wide_.across.get(); }
  Communicator* expert_data_axis() override { return wide_.data.get(); }
  std::vector<const Communicator*> communicators_beside_mesh() const override { return wide_.all(); }
  Status assemble_logits(const Tensor& local, Tensor& global) override {
    return model_.assemble_logits(comm_, local, global);
  }
  std::unique_ptr<StageSteps> begin(Backend& be, const ShardedWeights& w, ShardedGrads* g, int64_t batch) override {
    return std::make_unique<TspStageSteps>(model_, be, comm_, data_axis_, w, g, batch);
  }

 private:
  TspModel model_;
  Communicator& comm_;
  Communicator* data_axis_;
  ExpertDataAxes wide_;
};

}  // namespace

Result<std::unique_ptr<StageStrategy>> make_tsp_stage_strategy(const LlamaConfig& config, Communicator& tsp,
                                                               Communicator* dp, int64_t seq, const Layout& layout,
                                                               ExpertDataAxes wide) {
  FP_ASSIGN_OR_RETURN(TspModel model, TspModel::create(config, layout, tsp.rank(), seq));
  return std::unique_ptr<StageStrategy>(
      std::make_unique<TspStageStrategy>(std::move(model), tsp, dp, std::move(wide)));
}

}  // namespace foldpar
