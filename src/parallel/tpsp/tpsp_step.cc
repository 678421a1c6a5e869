// TpspStep: construction, the sp helpers, the loss's sums over sp and the sums of a step's
// partial gradients. The row mappings over tp, the embedding, head and vocabulary-parallel
// loss are TP's (parallel/tp_step_base.cc) on the sp shard's rows; the loss sum and valid
// count are then all_reduced over sp.
#include <algorithm>
#include <cmath>

#include "backend/rope_table.h"
#include "parallel/tpsp/tpsp_step.h"

namespace foldpar::tpsp_detail {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TpspStep::TpspStep(const TpspModel& model, Backend& backend, const TpspAxes& axes, const Batch& local)
    : TpStepBase(model.config(), model.dims(), backend, *axes.tp, model.tp_rank(), model.options().overlap,
                 model.options().sequence_parallel, tp_detail::TpRows{local.batch(), model.sp_seq(), model.local_seq()},
                 local),
      model_(model),
      opt_(model.options()),
      sp_(*axes.sp),
      gather_(model.options().kv_exchange == LayoutOptions::KvExchange::kAllGather) {
  FP_CHECK(sp_.size() == model.shard().degree() && sp_.rank() == model.shard().rank(),
           "TP x SP model for sp rank {} of {} on communicator {}", model.shard().rank(), model.shard().degree(),
           sp_.describe());
  const std::vector<int32_t>& mine = model.shard().positions();
  const std::vector<int32_t> all = model.shard().gathered_positions();
  q_pos_ = Tensor::empty({tp_seq_}, DType::kI32, MemCategory::kActivations);
  k_pos_ = Tensor::empty({model.shard().seq()}, DType::kI32, MemCategory::kActivations);
  std::copy(mine.begin(), mine.end(), q_pos_.data<int32_t>());
  std::copy(all.begin(), all.end(), k_pos_.data<int32_t>());
  rope_ = build_rope_table(mine, dims_.d, c_.rope_theta, DType::kF32);
}

// ---- sp: waits and the K/V exchange ----

void TpspStep::sp_wait(std::vector<CommRequest>& requests) {
  const auto t0 = std::chrono::steady_clock::now();
  for (CommRequest& r : requests) FP_CHECK_OK(r.wait());
  requests.clear();
  sp_wait_seconds_ += seconds_since(t0);
}

void TpspStep::sp_poke(std::vector<CommRequest>& requests) {
  for (CommRequest& r : requests) {
    bool done = false;
    FP_CHECK_OK(r.test(&done));
  }
}

void TpspStep::sp_blocking(const Status& status, std::chrono::steady_clock::time_point t0) {
  FP_CHECK_OK(status);
  sp_wait_seconds_ += seconds_since(t0);
}

// ---- the sums of a step's partial gradients ----

void TpspStep::sum_partials(TpspGrads& partial) {
  if (seq_par_) {
    // The gains saw only this rank's rows of the sp shard: sum over tp first.
    Tensor norms = partial.norm_region();
    tp_.all_reduce(norms);
  }
  // Every gradient saw only this sp rank's tokens. MPI counts are int: a 7B model's
  // gradient slices need several messages.
  constexpr int64_t kMaxElements = int64_t{1} << 30;
  Tensor& flat = partial.flat();
  const int64_t n = flat.numel();
  for (int64_t begin = 0; begin < n; begin += kMaxElements) {
    Tensor chunk = flat.narrow(begin, std::min(n, begin + kMaxElements));
    const auto t0 = std::chrono::steady_clock::now();
    sp_blocking(sp_.all_reduce(chunk.raw_data(), chunk.raw_data(), static_cast<size_t>(chunk.numel()), DType::kF32,
                               ReduceOp::kSum),
                t0);
  }
}

// ---- the loss over sp ----

StepResult TpspStep::head_forward(const ShardedWeights& w, const Tensor& x, HeadSaved& hs, Tensor* logits) {
  StepResult r = TpStepBase::head_forward(w, x, hs, logits);
  // The same sums on every tp rank of the group; over sp they add up to the global batch's.
  double sums[2] = {r.loss_sum, static_cast<double>(r.valid_tokens)};
  const auto t0 = std::chrono::steady_clock::now();
  sp_blocking(sp_.all_reduce(sums, sums, 2, DType::kF64, ReduceOp::kSum), t0);
  r.loss_sum = sums[0];
  r.valid_tokens = static_cast<int64_t>(sums[1]);
  r.loss = r.valid_tokens > 0 ? r.loss_sum / static_cast<double>(r.valid_tokens) : 0.0;
  return r;
}

}  // namespace foldpar::tpsp_detail
