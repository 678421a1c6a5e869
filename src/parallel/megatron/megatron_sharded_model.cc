// Megatron (tp=N, sp=M, tp=N,sp=M) behind the ShardedModel interface: WeightShardedModel
// owns the tp slices of the weights (replicated across sp; in the layout's storage dtype) and their gradients (one flat
// ShardedGrads buffer, summed over sp in one all_reduce); this adds the step over sequence-
// sharded tokens. A layout without one of the axes runs over
// a communicator of one rank for it (comm/self_communicator.h), which is never called.
#include <fmt/format.h>

#include "comm/self_communicator.h"
#include "parallel/megatron/megatron_model.h"
#include "parallel/strategies.h"

namespace foldpar {
namespace {

// The axis a layout lacks, as a communicator of this one rank (named after the axis).
std::unique_ptr<Communicator> make_missing_axis(const Communicator& present, const char* axis) {
  return std::make_unique<SelfCommunicator>(axis, present.world_ranks()[static_cast<size_t>(present.rank())]);
}

class MegatronShardedModel final : public WeightShardedModel {
 public:
  // self: the communicator of one rank standing for the axis the layout lacks (or null).
  // Every sp rank generates the same tp slices: identical replicas across sp, so sp rank 0
  // speaks for them; the norm gains are replicated on every rank: (tp 0, sp 0) speaks for
  // them. Assembly runs over tp only: every sp group holds the same slices (and, after a
  // step, the same summed gradients), so each group assembles the whole model on its own.
  // A MoE model: ep is the tp x sp group (owned here when split off the world), dp its
  // replicas; every rank of the group holds its own experts (WeightShardedModel's expert axis).
  // wide: the expert groups over dp replicas (ep = K tp sp), when K > 1.
  MegatronShardedModel(MegatronModel model, Communicator& tp, Communicator& sp, std::string layout,
                       std::unique_ptr<Communicator> self, std::unique_ptr<Communicator> ep_owned, Communicator* dp,
                       ExpertDataAxes wide)
      : WeightShardedModel(model.config(), model.dims(), tp, std::move(layout), model.options().dtype,
                           Counting{tp.rank() == 0 && sp.rank() == 0, sp.rank() == 0}),
        self_(std::move(self)),
        ep_owned_(std::move(ep_owned)),
        model_(std::move(model)),
        tp_(tp),
        sp_(sp),
        dp_(dp),
        wide_(std::move(wide)) {
    if (model_.config().moe.enabled()) {
      const int G = tp.size() * sp.size();
      ep_ = wide_.group ? wide_.group.get() : ep_owned_ != nullptr ? ep_owned_.get() : (sp.size() > 1 ? &sp : &tp);
      FP_CHECK(ep_->size() == model_.dims().expert_degree && ep_->rank() % G == sp.rank() * tp.size() + tp.rank(),
               "expert axis {} for tp rank {} of {}, sp rank {} of {}", ep_->describe(), tp.rank(), tp.size(),
               sp.rank(), sp.size());
      if (wide_.group)
        set_expert_axis(ep_->rank(), wide_.across.get(), wide_.data.get());
      else
        set_expert_axis(ep_->rank(), &sp);
    }
  }

  Batch local_batch(const Batch& global) const override { return model_.local_batch(global); }
  std::vector<const Communicator*> communicators_beside_mesh() const override {
    if (ep_owned_ != nullptr) return {ep_owned_.get()};
    return wide_.all();
  }
  Result<StepResult> forward_backward(Backend& be, const Batch& local, int64_t loss_normalizer) override {
    FP_ASSIGN_OR_RETURN(StepResult r, model_.forward_backward(be, MegatronAxes{&tp_, &sp_, ep_, dp_, wide_.data.get()}, weights_, local,
                                                              grads_, loss_normalizer));
    return with_aux_in_sum(std::move(r));
  }
  Result<StepResult> forward(Backend& be, const Batch& local) override {
    FP_ASSIGN_OR_RETURN(StepResult r, model_.forward(be, MegatronAxes{&tp_, &sp_, ep_, dp_, wide_.data.get()}, weights_, local));
    return with_aux_in_sum(std::move(r));
  }
  // Plain: the ranks of one sp communicator hold disjoint positions that cover the sequence
  // (the tp ranks of a group hold the same rows), so a sum over sp assembles the logits.
  // Sequence parallel: every rank's rows are its own; sum over tp, then over sp.
  Status assemble_logits(const Tensor& local, Tensor& global) override {
    return model_.assemble_logits(tp_, sp_, local, global);
  }

 private:
  // loss_sum carries the MoE aux term, as TSP's (tsp_sharded_model.cc): each dp replica adds
  // coef * aux (the global batch's) * its own valid tokens.
  StepResult with_aux_in_sum(StepResult r) const {
    const MoeConfig& moe = model_.config().moe;
    if (moe.enabled() && moe.output_router_logits)
      r.loss_sum += moe.router_aux_loss_coef * r.aux_loss * static_cast<double>(r.valid_tokens);
    return r;
  }

  std::unique_ptr<Communicator> self_;
  std::unique_ptr<Communicator> ep_owned_;
  MegatronModel model_;
  Communicator& tp_;
  Communicator& sp_;
  Communicator* dp_;
  ExpertDataAxes wide_;
  Communicator* ep_ = nullptr;
};

}  // namespace

Result<std::unique_ptr<ShardedModel>> make_megatron_sharded_model(const LlamaConfig& config, Communicator* tp,
                                                                  Communicator* sp, int64_t seq,
                                                                  const Layout& options,
                                                                  std::unique_ptr<Communicator> ep, Communicator* dp,
                                                                  ExpertDataAxes wide) {
  FP_CHECK(tp != nullptr || sp != nullptr, "a Megatron layout needs a tp or an sp axis");
  std::unique_ptr<Communicator> self;
  std::string layout;
  if (tp == nullptr) {
    self = make_missing_axis(*sp, "tp");
    tp = self.get();
    layout = fmt::format("sp={}", sp->size());
  } else if (sp == nullptr) {
    self = make_missing_axis(*tp, "sp");
    sp = self.get();
    layout = fmt::format("tp={}", tp->size());
  } else {
    layout = fmt::format("tp={},sp={}", tp->size(), sp->size());
  }
  FP_ASSIGN_OR_RETURN(MegatronModel model,
                      MegatronModel::create(config, options, tp->rank(), sp->rank(), seq));
  return std::unique_ptr<ShardedModel>(
      std::make_unique<MegatronShardedModel>(std::move(model), *tp, *sp, std::move(layout), std::move(self),
                                                                  std::move(ep), dp, std::move(wide)));
}

}  // namespace foldpar
