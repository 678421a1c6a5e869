// Megatron tensor parallelism (tp=N, one sp rank) as a pipeline stage
// (parallel/stage_strategy.h): one MegatronStep per micro-batch over the pipeline's stage
// weights, accumulating into the stage's gradients; with sequence parallelism each
// micro-batch's norm-gain partials are summed over tp when its backward ends, as
// MegatronModel::forward_backward does per call. (pp with sp > 1 is refused by
// validate_layout: its one sum over sp per step is not wired here yet.)
#include "comm/self_communicator.h"
#include "parallel/megatron/megatron_step.h"
#include "parallel/stage_strategy.h"
#include "parallel/strategies.h"

namespace foldpar {
namespace {

using megatron_detail::MegatronStep;
using megatron_detail::TpStepInputs;

class MegatronStageSteps final : public StageSteps {
 public:
  MegatronStageSteps(const MegatronModel& model, Backend& be, MegatronAxes axes, const ShardedWeights& w,
                     ShardedGrads* g)
      : model_(model), be_(be), axes_(axes), w_(w), g_(g) {}

  Result<std::unique_ptr<ModelStep>> micro_batch(const Batch& local, int64_t loss_normalizer) override {
    FP_RETURN_IF_ERROR(megatron_detail::check_local_batch(be_, model_, local));
    const Layout& o = model_.options();
    TpStepInputs in{&w_, g_ != nullptr ? &g_->views() : nullptr, loss_normalizer, o.keep_logits,
                    o.recompute == Recompute::kBlock};
    return std::unique_ptr<ModelStep>(std::make_unique<MegatronStep>(model_, be_, axes_, local, in));
  }
  void finish_micro_batch(ModelStep& step) override {
    auto& s = static_cast<MegatronStep&>(step);
    s.sum_partials(*g_);  // one sp rank: the gains over tp (sequence parallel), else nothing
    blocked_ += s.blocked_seconds();
  }
  void finish_backward() override {}
  double wait_seconds() const override { return blocked_; }

 private:
  const MegatronModel& model_;
  Backend& be_;
  MegatronAxes axes_;
  const ShardedWeights& w_;
  ShardedGrads* g_;
  double blocked_ = 0;
};

class MegatronStageStrategy final : public StageStrategy {
 public:
  MegatronStageStrategy(MegatronModel model, Communicator& tp, std::unique_ptr<Communicator> sp)
      : model_(std::move(model)), tp_(tp), sp_(std::move(sp)) {}

  Batch local_batch(const Batch& global) const override { return model_.local_batch(global); }
  const ShardDims& dims() const override { return model_.dims(); }
  Communicator& weight_axis() override { return tp_; }
  bool counts_replicated() const override { return tp_.rank() == 0; }
  Status assemble_logits(const Tensor& local, Tensor& global) override {
    global.zero();
    model_.scatter_rows(local, global);
    if (!model_.sequence_parallel()) return Status();  // every tp rank holds every row
    return tp_.all_reduce(global.raw_data(), global.raw_data(), static_cast<size_t>(global.numel()), DType::kF32,
                          ReduceOp::kSum);
  }
  std::unique_ptr<StageSteps> begin(Backend& be, const ShardedWeights& w, ShardedGrads* g, int64_t) override {
    return std::make_unique<MegatronStageSteps>(model_, be, MegatronAxes{&tp_, sp_.get()}, w, g);
  }

 private:
  MegatronModel model_;
  Communicator& tp_;
  std::unique_ptr<Communicator> sp_;  // one rank: the sp axis a pp=P,tp=N layout lacks
};

}  // namespace

Result<std::unique_ptr<StageStrategy>> make_megatron_stage_strategy(const LlamaConfig& config, Communicator& tp,
                                                                    int64_t seq, const Layout& layout) {
  FP_CHECK(layout.sp == 1, "a Megatron pipeline stage with sp={} (validate_layout refuses it)", layout.sp);
  FP_ASSIGN_OR_RETURN(MegatronModel model, MegatronModel::create(config, layout, tp.rank(), 0, seq));
  auto sp = std::make_unique<SelfCommunicator>("sp", tp.world_ranks()[static_cast<size_t>(tp.rank())]);
  return std::unique_ptr<StageStrategy>(std::make_unique<MegatronStageStrategy>(std::move(model), tp, std::move(sp)));
}

}  // namespace foldpar
