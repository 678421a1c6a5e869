// TpModel: validation, the local batch, and one tensor-parallel step (its order is
// run_tp_step in parallel/tp_step_base.h) or prefill.
#include "parallel/tp/tp_model.h"

#include "parallel/tp/tp_step.h"

namespace foldpar {

using tp_detail::run_tp_blocks;
using tp_detail::run_tp_step;
using tp_detail::TpStep;

Result<TpModel> TpModel::create(const LlamaConfig& config, int degree, int rank, int64_t seq,
                                const TpOptions& options) {
  FP_ASSIGN_OR_RETURN(ShardDims dims, shard_dims(config, degree, "tp"));
  if (rank < 0 || rank >= degree) return invalid_argument("tp rank {} outside the tp degree ({})", rank, degree);
  if (seq <= 0) return invalid_argument("sequence length ({}) must be positive", seq);
  if (options.sequence_parallel && seq % degree != 0)
    return invalid_argument("sequence length ({}) must be divisible by the tp degree ({}) with sequence parallelism",
                            seq, degree);
  return TpModel(config, dims, rank, seq, options);
}

Batch TpModel::local_batch(const Batch& global) const {
  if (!options_.sequence_parallel) return global;
  Result<SequenceShard> shard = SequenceShard::create(seq_, dims_.degree, rank_, SeqSplit::kContiguous);
  FP_CHECK_OK(shard.status());
  return shard->local_batch(global);
}

void TpModel::scatter_rows(const Tensor& local, Tensor& global) const {
  if (!options_.sequence_parallel) {
    global.copy_from(local);
    return;
  }
  Result<SequenceShard> shard = SequenceShard::create(seq_, dims_.degree, rank_, SeqSplit::kContiguous);
  FP_CHECK_OK(shard.status());
  shard->scatter_to_global(local, global);
}

namespace {

Status check_local_batch(const TpModel& m, const Batch& b) {
  FP_RETURN_IF_ERROR(validate_batch(m.config(), b));
  if (b.seq() != m.local_seq())
    return invalid_argument("local batch has {} tokens per sequence, the tp rank holds {} (S {}{})", b.seq(),
                            m.local_seq(), m.seq(), m.options().sequence_parallel ? " / tp degree" : "");
  return Status();
}

}  // namespace

Result<StepResult> TpModel::forward(Backend& be, Communicator& tp, const ShardedWeights& w, const Batch& batch) const {
  FP_RETURN_IF_ERROR(check_local_batch(*this, batch));
  TpStep step(*this, be, tp, batch);
  StepResult r = run_tp_step(step, options_.recompute, options_.keep_logits, w, nullptr, 0);
  r.exposed_comm_seconds = step.blocked_seconds();
  return r;
}

Result<Tensor> TpModel::prefill(Backend& be, Communicator& tp, const ShardedWeights& w, const Tensor& ids,
                                KvCache& cache, double* exposed_comm_seconds) const {
  if (options_.sequence_parallel) return invalid_argument("prefill runs plain tensor parallelism, not sequence-parallel");
  if (ids.rank() != 2 || ids.dtype() != DType::kI32 || ids.dim(1) != seq_)
    return invalid_argument("prefill ids {}: expected i32 [B, {}]", ids.describe(), seq_);
  TpStep step(*this, be, tp, Batch{ids, ids});  // no head: the targets are never read
  step.set_kv_cache(&cache);
  Tensor x = step.embed(w);
  x = run_tp_blocks(step, options_.recompute, w, x, nullptr);
  if (exposed_comm_seconds != nullptr) *exposed_comm_seconds += step.blocked_seconds();
  return x;
}

Result<StepResult> TpModel::forward_backward(Backend& be, Communicator& tp, const ShardedWeights& w,
                                             const Batch& batch, ShardedWeights& g, int64_t loss_normalizer) const {
  FP_RETURN_IF_ERROR(check_local_batch(*this, batch));
  TpStep step(*this, be, tp, batch);
  StepResult r = run_tp_step(step, options_.recompute, options_.keep_logits, w, &g, loss_normalizer);
  step.sum_norm_partials(g);
  r.exposed_comm_seconds = step.blocked_seconds();
  return r;
}

}  // namespace foldpar
