// Megatron (tp=N, sp=M, tp=N,sp=M) as a pipeline stage (parallel/stage_strategy.h): one
// MegatronStep per micro-batch over the pipeline's stage weights, accumulating into the
// stage's gradients. Each micro-batch's attention-variant partials are summed over tp when
// its backward ends. One sp rank: so are, with sequence parallelism, its norm-gain partials,
// as MegatronModel::forward_backward does per call. Several sp ranks: the step's accumulated
// gradients are summed over sp (gains over tp first with sequence parallelism) once, after
// the last backward, so they must start the step at zero (ShardedModel::zero_grads). A MoE
// model: each micro-batch's MegatronStep records its own routing statistics (those of the
// stages before arrive with its activation, ModelStep::set_routing_stats), and the last
// stage sums them over the expert axis (tp x sp) and dp, as the step without pp does.
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
      : model_(model), be_(be), axes_(axes), w_(w), g_(g), zero_at_start_(g == nullptr || g->known_zero()) {}

  Result<std::unique_ptr<ModelStep>> micro_batch(const Batch& local, int64_t loss_normalizer) override {
    FP_RETURN_IF_ERROR(megatron_detail::check_local_batch(be_, model_, local));
    if (!local_axis() && g_ != nullptr && !zero_at_start_)
      return invalid_argument("{}: a pipeline step with sp={} sums its gradients over sp, so they must start at zero "
                              "(zero_grads before each step)",
                              model_.options().to_string(), axes_.sp->size());
    const Layout& o = model_.options();
    TpStepInputs in{&w_, g_ != nullptr ? &g_->views() : nullptr, loss_normalizer, o.keep_logits,
                    o.recompute == Recompute::kBlock};
    // Its own step, so its own routing statistics and aux gradient while others are in flight.
    return std::unique_ptr<ModelStep>(std::make_unique<MegatronStep>(model_, be_, axes_, local, in));
  }
  void finish_micro_batch(ModelStep& step) override {
    auto& s = static_cast<MegatronStep&>(step);
    // One sp rank: the variants over tp and the gains over tp (sequence parallel). Several:
    // the variants over tp now, everything over sp in finish_backward.
    if (local_axis()) s.sum_partials(*g_);
    else s.sum_variant_partials(*g_);
    blocked_ += s.blocked_seconds();
  }
  void finish_backward() override {
    if (local_axis()) return;
    TpComm tp(*axes_.tp, be_, model_.options().overlap);
    megatron_detail::sum_grads_over_sp(tp, *axes_.sp, model_.sequence_parallel(), *g_);
    blocked_ += tp.blocked_seconds();
    g_->mark_written();
  }
  double wait_seconds() const override { return blocked_; }

 private:
  bool local_axis() const { return axes_.sp->size() == 1; }

  const MegatronModel& model_;
  Backend& be_;
  MegatronAxes axes_;
  const ShardedWeights& w_;
  ShardedGrads* g_;
  bool zero_at_start_;
  double blocked_ = 0;
};

// tp and sp: the layout's axes, or communicators of one rank standing for the one it lacks
// (owned in self_). Every sp rank holds the same tp slices: sp rank 0 speaks for them, and
// (tp 0, sp 0) for the replicated gains. A MoE model: ep is the tp x sp group (owned here
// when split off the world; tp or sp itself where the other has one rank), every rank of it
// holding its own experts; dp the replicas its routing statistics are summed over. wide: this
// stage's expert groups over dp replicas (ep = K tp sp, K > 1), which replace ep, as
// MegatronShardedModel's: the dispatch over the group, the statistics over it and its
// expert-data replicas, assembly summing the experts over the group's ranks of this tp rank.
class MegatronStageStrategy final : public StageStrategy {
 public:
  MegatronStageStrategy(MegatronModel model, Communicator& tp, Communicator& sp, std::unique_ptr<Communicator> self,
                        std::unique_ptr<Communicator> ep_owned, Communicator* dp, ExpertDataAxes wide)
      : model_(std::move(model)),
        tp_(tp),
        sp_(sp),
        self_(std::move(self)),
        ep_owned_(std::move(ep_owned)),
        dp_(dp),
        wide_(std::move(wide)) {
    if (!model_.config().moe.enabled()) return;
    const int G = tp.size() * sp.size();
    ep_ = wide_.group ? wide_.group.get() : ep_owned_ != nullptr ? ep_owned_.get() : (sp.size() > 1 ? &sp : &tp);
    FP_CHECK(ep_->size() == model_.dims().expert_degree && ep_->rank() % G == sp.rank() * tp.size() + tp.rank(),
             "expert axis {} for tp rank {} of {}, sp rank {} of {}", ep_->describe(), tp.rank(), tp.size(), sp.rank(),
             sp.size());
  }

  Batch local_batch(const Batch& global) const override { return model_.local_batch(global); }
  const ShardDims& dims() const override { return model_.dims(); }
  Communicator& weight_axis() override { return tp_; }
  bool counts_replicated() const override { return tp_.rank() == 0 && sp_.rank() == 0; }
  bool counts_sharded() const override { return sp_.rank() == 0; }
  int expert_rank() const override { return ep_ != nullptr ? ep_->rank() : -1; }
  Communicator* expert_across() override {
    if (wide_.group) return wide_.across.get();
    return ep_ != nullptr ? &sp_ : nullptr;
  }
  Communicator* expert_data_axis() override { return wide_.data.get(); }
  std::vector<const Communicator*> communicators_beside_mesh() const override {
    if (ep_owned_ != nullptr) return {ep_owned_.get()};
    return wide_.all();
  }
  Status assemble_logits(const Tensor& local, Tensor& global) override {
    return model_.assemble_logits(tp_, sp_, local, global);
  }
  std::unique_ptr<StageSteps> begin(Backend& be, const ShardedWeights& w, ShardedGrads* g, int64_t) override {
    return std::make_unique<MegatronStageSteps>(model_, be, MegatronAxes{&tp_, &sp_, ep_, dp_, wide_.data.get()}, w,
                                                g);
  }

 private:
  MegatronModel model_;
  Communicator& tp_;
  Communicator& sp_;
  std::unique_ptr<Communicator> self_;
  std::unique_ptr<Communicator> ep_owned_;
  Communicator* dp_;
  ExpertDataAxes wide_;
  Communicator* ep_ = nullptr;
};

}  // namespace

Result<std::unique_ptr<StageStrategy>> make_megatron_stage_strategy(const LlamaConfig& config, Communicator* tp,
                                                                    Communicator* sp, int64_t seq,
                                                                    const Layout& layout,
                                                                    std::unique_ptr<Communicator> ep,
                                                                    Communicator* dp, ExpertDataAxes wide) {
  FP_CHECK(tp != nullptr || sp != nullptr, "a Megatron stage needs a tp or an sp axis");
  const Communicator& present = tp != nullptr ? *tp : *sp;
  std::unique_ptr<Communicator> self;
  if (tp == nullptr || sp == nullptr) {
    self = std::make_unique<SelfCommunicator>(tp == nullptr ? "tp" : "sp",
                                              present.world_ranks()[static_cast<size_t>(present.rank())]);
    (tp == nullptr ? tp : sp) = self.get();
  }
  FP_ASSIGN_OR_RETURN(MegatronModel model, MegatronModel::create(config, layout, tp->rank(), sp->rank(), seq));
  return std::unique_ptr<StageStrategy>(
      std::make_unique<MegatronStageStrategy>(std::move(model), *tp, *sp, std::move(self), std::move(ep), dp,
                                                                               std::move(wide)));
}

}  // namespace foldpar
