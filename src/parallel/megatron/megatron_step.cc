// MegatronStep: construction, the loss's sums over sp and the sums of a step's partial
// gradients. The row mappings over tp, the embedding, head and vocabulary-parallel loss are
// the tp half's (tp_step_base.cc) on the sp shard's rows; the loss sum and valid count are
// then all_reduced over sp. Nothing is issued on an sp axis of one rank.
#include "parallel/megatron/megatron_step.h"

#include <algorithm>

#include "backend/rope_table.h"

namespace foldpar::megatron_detail {

MegatronStep::MegatronStep(const MegatronModel& model, Backend& backend, const MegatronAxes& axes, const Batch& local,
                           TpStepInputs in)
    : TpStepBase(model.config(), model.dims(), backend, *axes.tp, model.tp_rank(), model.options().overlap,
                 model.sequence_parallel(), model.options().dtype,
                 TpRows{local.batch(), model.sp_seq(), model.local_seq()}, local, in),
      model_(model),
      opt_(model.options()),
      sp_(*axes.sp),
      local_(model.sp_degree() == 1),
      gather_(!local_ && model.options().kv_exchange == Layout::KvExchange::kAllGather),
      dp_(model.config().moe.enabled() ? axes.dp : nullptr),
      expert_dp_(model.config().moe.enabled() ? axes.expert_dp : nullptr) {
  set_expert_axis(axes.ep);
  FP_CHECK(sp_.size() == model.shard().degree() && sp_.rank() == model.shard().rank(),
           "Megatron model for sp rank {} of {} on communicator {}", model.shard().rank(), model.shard().degree(),
           sp_.describe());
  if (seq_par_ && local_)
    for (int64_t i = 0; i < 2 * c_.num_hidden_layers + 1; ++i) {
      norm_partials_.push_back(Tensor::empty({dims_.h}, DType::kF32, MemCategory::kGradients));
      be_.fill(0.0, norm_partials_.back());
    }
  q_positions_ = model.shard().positions();
  q_pos_ = Tensor::empty({tp_seq_}, DType::kI32, MemCategory::kActivations);
  be_.copy_from_host(std::as_bytes(std::span<const int32_t>(q_positions_)), q_pos_);
  if (local_) {
    k_pos_ = q_pos_;  // every position, in order
  } else {
    k_positions_ = model.shard().gathered_positions();
    k_pos_ = Tensor::empty({model.shard().seq()}, DType::kI32, MemCategory::kActivations);
    be_.copy_from_host(std::as_bytes(std::span<const int32_t>(k_positions_)), k_pos_);
  }
  rope_ = build_rope_table(be_, q_positions_, c_.rope_spec(), model.shard().seq(), DType::kF32);
  set_positions(&q_pos_, &rope_);
}

Tensor& MegatronStep::norm_grad(Tensor& grad, int index) {
  return norm_partials_.empty() ? grad : norm_partials_[static_cast<size_t>(index)];
}

// ---- the sums of a step's partial gradients ----

void MegatronStep::sum_partials(ShardedGrads& partial) {
  sum_variant_grads(partial.views());  // over tp; over sp with the rest of the flat buffer below
  if (local_) {
    if (norm_partials_.empty()) return;
    // One all_reduce of every gain's partial over tp, packed: [(2L+1) * h], then into the
    // gradients.
    sum_norm_partials(be_, norm_partials_, partial.views(), [this](Tensor& packed) { tp_.all_reduce(packed); });
    return;
  }
  sum_grads_over_sp(tp_, sp_, seq_par_, partial);
}

void sum_grads_over_sp(TpComm& tp, Communicator& sp, bool seq_par, ShardedGrads& partial) {
  if (seq_par) {
    // The gains saw only this rank's rows of the sp shard: sum over tp first.
    Tensor norms = partial.norm_region();
    tp.all_reduce(norms);
  }
  // Every gradient saw only this sp rank's tokens. MPI counts are int: a 7B model's
  // gradient slices need several messages. A MoE model's routed experts spread over tp x sp
  // (expert parallelism) are each rank's own, complete: their regions are left out (one
  // all_reduce per stretch between them).
  constexpr int64_t kMaxElements = int64_t{1} << 30;
  Tensor& flat = partial.flat();
  const int64_t n = flat.numel();
  std::vector<std::pair<int64_t, int64_t>> stretches;
  int64_t at = 0;
  if (partial.views().dims.expert_degree > partial.views().dims.degree)
    for (const auto& [b, e] : partial.expert_regions()) {
      if (b > at) stretches.emplace_back(at, b);
      at = e;
    }
  if (n > at) stretches.emplace_back(at, n);
  for (const auto& [first, last] : stretches)
    for (int64_t begin = first; begin < last; begin += kMaxElements) {
      Tensor chunk = flat.narrow(begin, std::min(last, begin + kMaxElements));
      const auto t0 = StepTimer::Clock::now();
      tp.timer().blocking(sp.all_reduce(chunk.raw_data(), chunk.raw_data(), static_cast<size_t>(chunk.numel()),
                                        DType::kF32, ReduceOp::kSum),
                          t0);
    }
}

// ---- the loss over sp ----

StepResult MegatronStep::head_forward(const Tensor& x, bool save) {
  StepResult r = TpStepBase::head_forward(x, save);
  if (!local_) {
    // The same sums on every tp rank of the group; over sp they add up to the global batch's.
    double sums[2] = {r.loss_sum, static_cast<double>(r.valid_tokens)};
    const auto t0 = StepTimer::Clock::now();
    tp_.timer().blocking(sp_.all_reduce(sums, sums, 2, DType::kF64, ReduceOp::kSum), t0);
    r.loss_sum = sums[0];
    r.valid_tokens = static_cast<int64_t>(sums[1]);
    r.loss = r.valid_tokens > 0 ? r.loss_sum / static_cast<double>(r.valid_tokens) : 0.0;
  }
  step_valid_ = r.valid_tokens;
  const MoeConfig& moe = c_.moe;
  if (moe.enabled()) {
    // The routing statistics of the expert axis (and of the dp replicas): the single-rank
    // model's aux loss on the global batch (tp_moe.cc).
    aux_ = std::make_unique<MoeAux>(sum_moe_stats(dp_, expert_dp_, &step_valid_));
    r.aux_loss = aux_->loss(moe.aux_per_layer);
    r.expert_load = aux_->load();
    r.moe_dropped = aux_->dropped_pairs();
    if (moe.output_router_logits) r.loss += moe.router_aux_loss_coef * r.aux_loss;
  }
  return r;
}

Tensor MegatronStep::head_backward(const StepResult& r) {
  const MoeConfig& moe = c_.moe;
  if (moe.enabled() && moe.output_router_logits && aux_ != nullptr) {
    // Accumulating: this micro-batch's aux term weighs its share of the step's valid tokens
    // (own: the micro-batch's over sp and dp), as loss_sum carries it (TSP's rule).
    const int64_t own = step_valid_ >= 0 ? step_valid_ : r.valid_tokens;
    const int64_t normalizer = in_.loss_normalizer > 0 ? in_.loss_normalizer : own;
    const double share = normalizer > 0 ? static_cast<double>(own) / static_cast<double>(normalizer) : 1.0;
    set_moe_prob_grad(aux_->prob_grad(moe.router_aux_loss_coef * share, moe.aux_per_layer));
  }
  return TpStepBase::head_backward(r);
}

}  // namespace foldpar::megatron_detail
