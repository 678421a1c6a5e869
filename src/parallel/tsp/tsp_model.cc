// TspModel: validation and TSP's parts of the model's step order (model/step_order.h):
// embedding ring, L blocks of broadcast attention + ring MLP, the vocabulary-sharded head and
// loss, then the adjoint in reverse.
#include "parallel/tsp/tsp_model.h"

#include "model/step_order.h"
#include "parallel/tsp/tsp_step.h"

namespace foldpar {

using tsp_detail::HeadSaved;
using tsp_detail::LayerSaved;
using tsp_detail::TspStep;

Status TspModel::assemble_logits(Communicator& tsp, const Tensor& local, Tensor& global) const {
  global.zero();
  shard_.scatter_to_global(local, global);
  return tsp.all_reduce(global.raw_data(), global.raw_data(), static_cast<size_t>(global.numel()), DType::kF32,
                        ReduceOp::kSum);
}

void TspModel::set_expert_axes(const Communicator& tsp, Communicator* group, Communicator* expert_data) {
  FP_CHECK(group != nullptr && group->size() == dims_.expert_degree && group->rank() % tsp.size() == tsp.rank(),
           "expert group {} for tsp rank {} of {}", group != nullptr ? group->describe() : "(none)", tsp.rank(),
           tsp.size());
  expert_group_ = group;
  expert_data_ = expert_data;
}

Result<TspModel> TspModel::create(const LlamaConfig& config, const Layout& layout, int rank, int64_t seq) {
  FP_CHECK(layout.strategy == Strategy::kTsp, "TspModel for layout {}", layout.to_string());
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, seq));
  return TspModel(config, shard_dims(config, layout.tsp, config.moe.enabled() ? layout.expert_ranks() : 0),
                  SequenceShard::create(seq, layout.tsp, rank, layout.split),
                  layout);
}

namespace {

// A dry run's MoE layers route as the meta backend assumes (planned_moe_routing,
// backend/meta/meta_backend.h): the copies of expert ids and counts to the host read that.
Status check_local_batch(Backend& be, const TspModel& m, const Batch& b) {
  FP_RETURN_IF_ERROR(validate_batch(be, m.config(), b));
  if (b.seq() != m.shard().local_seq())
    return invalid_argument("local batch has {} tokens per sequence, the TSP shard holds {} (S {} / D {})", b.seq(),
                            m.shard().local_seq(), m.shard().seq(), m.shard().degree());
  return Status();
}

// One TSP step's parts on this rank, for the model's step order (model/step_order.h).
struct StepInputs {
  Tensor ids, targets;             // i32 [T] (targets undefined for a prefill)
  int64_t batch = 0;               // B
  ShardedWeights* grads = nullptr;  // null for a forward only
  int64_t loss_normalizer = 0;     // as in TspModel::forward_backward
  Communicator* data_axis = nullptr;  // MoE: the replicas the routing statistics are summed over
};

class TspModelStep final : public ModelStep {
 public:
  TspModelStep(TspStep& step, const TspModel& m, const ShardedWeights& w, StepInputs in)
      : step_(step),
        m_(m),
        w_(w),
        in_(std::move(in)),
        saved_(w.attn.size()),
        stats_(m.config().moe.num_experts, m.config().moe.sparse_layer_count(m.config().num_hidden_layers)) {}

  Tensor embed_forward() override { return step_.embed(w_, in_.ids); }

  Tensor block_forward(int64_t l, const Tensor& x, bool save) override {
    LayerSaved* s = save ? &saved_[l] : nullptr;
    Tensor x_mid = step_.attention_forward(static_cast<int>(l), w_, x, s != nullptr ? &s->attn : nullptr);
    if (!w_.moe[l].defined())
      return step_.mlp_forward(static_cast<int>(l), w_, x_mid, s != nullptr ? &s->mlp : nullptr);
    step_.set_moe_stats(&stats_);  // the step is shared by the micro-batches in flight
    Tensor y = step_.moe_forward(static_cast<int>(l), w_, x_mid, s != nullptr ? &s->moe : nullptr);
    step_.set_moe_stats(nullptr);
    return y;
  }

  StepResult head_forward(const Tensor& x, bool /*save: the head always keeps its state*/) override {
    const bool keep_logits = m_.options().keep_logits;
    Tensor logits;
    StepResult r = step_.head_forward(w_, x, in_.targets, hs_, keep_logits ? &logits : nullptr);
    const MoeConfig& moe = m_.config().moe;
    step_valid_ = r.valid_tokens;
    if (moe.enabled()) {
      // The routing statistics of the whole axis (and of the dp replicas): the single-rank
      // model's aux loss on the global batch.
      aux_ = std::make_unique<MoeAux>(step_.sum_moe_stats(stats_, in_.data_axis, &step_valid_));
      r.aux_loss = aux_->loss(moe.aux_per_layer);
      r.expert_load = aux_->load();
      r.moe_dropped = aux_->dropped_pairs();
      if (moe.output_router_logits) r.loss += moe.router_aux_loss_coef * r.aux_loss;
    }
    if (keep_logits) r.logits = logits.reshape({in_.batch, m_.shard().local_seq(), m_.config().vocab_size});
    return r;
  }

  Tensor head_backward(const StepResult& r) override {
    const int64_t own = step_valid_ >= 0 ? step_valid_ : r.valid_tokens;
    const int64_t normalizer = in_.loss_normalizer > 0 ? in_.loss_normalizer : own;
    const MoeConfig& moe = m_.config().moe;
    if (moe.enabled() && moe.output_router_logits && aux_ != nullptr) {
      // Accumulating: this micro-batch's aux term weighs its share of the step's valid tokens
      // (own: the micro-batch's over the axis and dp), as loss_sum carries it.
      const double share = normalizer > 0 ? static_cast<double>(own) / static_cast<double>(normalizer) : 1.0;
      prob_grad_ = aux_->prob_grad(moe.router_aux_loss_coef * share, moe.aux_per_layer);
    }
    Tensor dx = step_.head_backward(w_, hs_, in_.targets, normalizer, *in_.grads);
    hs_ = HeadSaved();
    return dx;
  }

  Tensor block_backward(int64_t l, Tensor dx) override {
    LayerSaved& s = saved_[l];
    step_.set_weight_grads(deferred_);  // the step is shared by the micro-batches in flight
    step_.set_moe_prob_grad(&prob_grad_);
    dx = w_.moe[l].defined() ? step_.moe_backward(static_cast<int>(l), w_, s.moe, dx, *in_.grads)
                             : step_.mlp_backward(static_cast<int>(l), w_, s.mlp, dx, *in_.grads);  // frees d(x_out)
    dx = step_.attention_backward(static_cast<int>(l), w_, s.attn, dx, *in_.grads);
    step_.set_moe_prob_grad(nullptr);
    step_.set_weight_grads(nullptr);
    s = LayerSaved();
    return dx;
  }

  // D > 1: what sends each weight gradient home (the attention shard's reduce to its owner,
  // the MLP's gradient ring) is queued behind its products (TspStep::set_weight_grads). MoE
  // layers' expert gradients are summed by their dispatch during the backward: not split.
  bool defer_weight_grads(WeightGradQueue* queue) override {
    if (queue != nullptr && m_.config().moe.enabled()) return false;
    deferred_ = queue;
    return true;
  }

  void embed_backward(const Tensor& dx) override { step_.embed_backward(in_.ids, dx, *in_.grads); }

  // Under pp: this rank's rows' statistics travel with the micro-batch (the same TSP index
  // of every stage holds the same rows), summed over the axis and dp on the last stage only.
  std::vector<double> routing_stats() const override {
    return m_.config().moe.enabled() ? stats_.pack() : std::vector<double>{};
  }
  void set_routing_stats(const std::vector<double>& stats) override { stats_.unpack(stats); }
  std::vector<double> aux_prob_grad() const override { return MoeAux::flatten(prob_grad_); }
  void set_aux_prob_grad(const std::vector<double>& g) override { prob_grad_ = stats_.unflatten(g); }

 private:
  TspStep& step_;
  const TspModel& m_;
  const ShardedWeights& w_;
  StepInputs in_;
  std::vector<LayerSaved> saved_;  // per layer
  HeadSaved hs_;
  MoeAux stats_;                   // MoE: this rank's rows' routing statistics (under pp, the stages' before too)
  std::unique_ptr<MoeAux> aux_;    // MoE: the step's routing statistics summed over the axis (and dp)
  std::vector<std::vector<double>> prob_grad_;  // MoE: the aux loss's gradient per sparse layer [E]
  // The valid targets of this micro-batch over the axis, and for a MoE model over the dp
  // replicas too (the whole global batch's when it is one micro-batch); -1 before the head.
  int64_t step_valid_ = -1;
  WeightGradQueue* deferred_ = nullptr;  // defer_weight_grads
};

}  // namespace

namespace tsp_detail {

std::unique_ptr<ModelStep> make_model_step(TspStep& step, const TspModel& m, const ShardedWeights& w,
                                           const Batch& local, ShardedWeights* grads, int64_t loss_normalizer,
                                           Communicator* data_axis) {
  const int64_t T = local.input_ids.numel();
  return std::make_unique<TspModelStep>(step, m, w,
                                        StepInputs{local.input_ids.reshape({T}), local.target_ids.reshape({T}),
                                                   local.batch(), grads, loss_normalizer, data_axis});
}

Status check_local_batch(Backend& be, const TspModel& m, const Batch& local) {
  return foldpar::check_local_batch(be, m, local);
}

}  // namespace tsp_detail

Result<StepResult> TspModel::forward(Backend& be, Communicator& tsp, const ShardedWeights& w, const Batch& batch,
                                     Communicator* data_axis) const {
  FP_RETURN_IF_ERROR(check_local_batch(be, *this, batch));
  TspStep step(*this, be, tsp, batch.batch());
  const int64_t T = batch.input_ids.numel();
  TspModelStep parts(step, *this, w,
                     {batch.input_ids.reshape({T}), batch.target_ids.reshape({T}), batch.batch(), nullptr, 0, data_axis});
  StepResult r = step_forward(parts, static_cast<int64_t>(w.attn.size()));
  r.exposed_comm_seconds = step.wait_seconds();
  return r;
}

Result<Tensor> TspModel::prefill(Backend& be, Communicator& tsp, const ShardedWeights& w, const Tensor& ids,
                                 KvCache& cache, double* exposed_comm_seconds) const {
  return prefill_stage(be, tsp, w, ids, StageLayers{}, Tensor(), cache, exposed_comm_seconds);
}

Result<Tensor> TspModel::prefill_stage(Backend& be, Communicator& tsp, const ShardedWeights& w, const Tensor& ids,
                                       const StageLayers& stage, Tensor x, KvCache& cache,
                                       double* exposed_comm_seconds) const {
  if (ids.rank() != 2 || ids.dtype() != DType::kI32 || ids.dim(1) != shard_.local_seq())
    return invalid_argument("prefill ids {}: expected i32 [B, {}] (S {} / D {})", ids.describe(), shard_.local_seq(),
                            shard_.seq(), shard_.degree());
  TspStep step(*this, be, tsp, ids.dim(0));
  step.set_kv_cache(&cache);
  TspModelStep parts(step, *this, w, {ids.reshape({ids.numel()}), Tensor(), ids.dim(0)});
  if (stage.embed) x = parts.embed_forward();
  const int64_t end = stage.end < 0 ? static_cast<int64_t>(w.attn.size()) : stage.end;
  for (int64_t l = stage.first; l < end; ++l) x = parts.block_forward(l, x, false);
  if (exposed_comm_seconds != nullptr) *exposed_comm_seconds += step.wait_seconds();
  return x;
}

Result<StepResult> TspModel::forward_backward(Backend& be, Communicator& tsp, const ShardedWeights& w,
                                              const Batch& batch, ShardedWeights& g, int64_t loss_normalizer,
                                              Communicator* data_axis) const {
  FP_RETURN_IF_ERROR(check_local_batch(be, *this, batch));
  TspStep step(*this, be, tsp, batch.batch());
  const int64_t T = batch.input_ids.numel();
  TspModelStep parts(step, *this, w,
                     {batch.input_ids.reshape({T}), batch.target_ids.reshape({T}), batch.batch(), &g, loss_normalizer,
                      data_axis});
  StepResult r = step_forward_backward(parts, static_cast<int64_t>(w.attn.size()), options_.recompute);
  step.sum_norm_partials(g);
  r.exposed_comm_seconds = step.wait_seconds();
  return r;
}

}  // namespace foldpar
