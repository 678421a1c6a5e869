// MegatronModel: validation, and one step: the model's step order (model/step_order.h) over
// a MegatronStep (parallel/megatron/megatron_step.h), then the sums of the step's partial
// gradients; and generation's prefill.
#include "parallel/megatron/megatron_model.h"

#include "model/step_order.h"
#include "parallel/megatron/megatron_step.h"

namespace foldpar {

using megatron_detail::MegatronStep;
using megatron_detail::TpStepInputs;

MegatronModel::MegatronModel(const LlamaConfig& config, ShardDims dims, int tp_rank, SequenceShard shard,
                             const Layout& options)
    : config_(config),
      dims_(dims),
      tp_rank_(tp_rank),
      shard_(std::move(shard)),
      options_(options),
      seq_par_(options.sequence_parallel && dims.degree > 1) {
  // This rank's rows: the sp shard's, or with sequence parallelism the tp rank's
  // contiguous block of them.
  const std::vector<int32_t>& all = shard_.positions();
  const int64_t n = seq_par_ ? shard_.local_seq() / dims_.degree : shard_.local_seq();
  const int64_t first = seq_par_ ? tp_rank_ * n : 0;
  positions_.assign(all.begin() + first, all.begin() + first + n);
}

Result<MegatronModel> MegatronModel::create(const LlamaConfig& config, const Layout& layout, int t, int p,
                                            int64_t seq, bool for_prefill) {
  FP_CHECK(layout.strategy == Strategy::kMegatron, "MegatronModel for layout {}", layout.to_string());
  FP_CHECK(!for_prefill || (layout.sp == 1 && !layout.sequence_parallel), "prefill model for layout {}",
           layout.to_string());
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, for_prefill ? 0 : seq));
  FP_CHECK(t >= 0 && t < layout.tp && p >= 0 && p < layout.sp, "rank ({}, {}) of layout {}", t, p,
           layout.to_string());
  // One sp rank holds every position in order, whatever the split.
  const SeqSplit split = layout.sp == 1 ? SeqSplit::kContiguous : layout.split;
  // A MoE model's experts spread over the tp x sp group (expert parallelism, tp_moe.cc), or
  // over ep = K tp sp ranks of K dp replicas (Layout::ep).
  const int expert_degree = config.moe.enabled() ? layout.expert_ranks() : 0;
  return MegatronModel(config, shard_dims(config, layout.tp, expert_degree), t, SequenceShard::create(seq, layout.sp, p, split),
                       layout);
}

Batch MegatronModel::local_batch(const Batch& global) const {
  FP_CHECK(global.seq() == shard_.seq(), "batch of S={} for a model of S={}", global.seq(), shard_.seq());
  if (local_seq() == shard_.seq()) return global;  // every position, in order: the global batch itself
  return batch_rows_at(global, positions_);
}

Status MegatronModel::assemble_logits(Communicator& tp, Communicator& sp, const Tensor& local, Tensor& global) const {
  FP_CHECK(global.dim(1) == shard_.seq(), "scatter of {} into {}", local.describe(), global.describe());
  global.zero();
  scatter_rows_to(local, positions_, global);
  const size_t n = static_cast<size_t>(global.numel());
  if (seq_par_)  // each tp rank holds its own rows
    FP_RETURN_IF_ERROR(tp.all_reduce(global.raw_data(), global.raw_data(), n, DType::kF32, ReduceOp::kSum));
  if (sp.size() == 1) return Status();
  return sp.all_reduce(global.raw_data(), global.raw_data(), n, DType::kF32, ReduceOp::kSum);
}

namespace {

Status check_local_batch(Backend& be, const MegatronModel& m, const Batch& b) {
  FP_RETURN_IF_ERROR(validate_batch(be, m.config(), b));
  if (b.seq() != m.local_seq())
    return invalid_argument("local batch has {} tokens per sequence, this rank holds {} (S {} / sp degree {}{})",
                            b.seq(), m.local_seq(), m.shard().seq(), m.shard().degree(),
                            m.sequence_parallel() ? " / tp degree" : "");
  return Status();
}

}  // namespace

namespace megatron_detail {

Status check_local_batch(Backend& be, const MegatronModel& m, const Batch& local) {
  return foldpar::check_local_batch(be, m, local);
}

}  // namespace megatron_detail

Result<StepResult> MegatronModel::forward(Backend& be, const MegatronAxes& axes, const ShardedWeights& w,
                                          const Batch& batch) const {
  FP_RETURN_IF_ERROR(check_local_batch(be, *this, batch));
  MegatronStep step(*this, be, axes, batch, TpStepInputs{&w, nullptr, 0, options_.keep_logits, false});
  StepResult r = step_forward(step, config_.num_hidden_layers);
  r.exposed_comm_seconds = step.blocked_seconds();
  return r;
}

Result<StepResult> MegatronModel::forward_backward(Backend& be, const MegatronAxes& axes, const ShardedWeights& w,
                                                   const Batch& batch, ShardedGrads& grads,
                                                   int64_t loss_normalizer) const {
  FP_RETURN_IF_ERROR(check_local_batch(be, *this, batch));
  // Over sp only this step's partial is summed: it accumulates straight into gradients known
  // to be zero, otherwise into a scratch buffer added afterwards. With one sp rank nothing
  // is summed over sp and the step accumulates into the gradients themselves.
  const bool in_place = sp_degree() == 1 || grads.known_zero();
  ShardedGrads scratch;
  if (!in_place) {
    scratch = ShardedGrads::allocate(config_, dims_, tp_rank_, MemCategory::kGradients);
    be.fill(0.0, scratch.flat());
  }
  ShardedGrads& partial = in_place ? grads : scratch;
  const bool recompute = options_.recompute == Recompute::kBlock;
  MegatronStep step(*this, be, axes, batch,
                    TpStepInputs{&w, &partial.views(), loss_normalizer, options_.keep_logits, recompute});
  StepResult r = step_forward_backward(step, config_.num_hidden_layers, options_.recompute);
  step.sum_partials(partial);
  if (!in_place) be.add_inplace(scratch.flat(), grads.flat());
  grads.mark_written();
  r.exposed_comm_seconds = step.blocked_seconds();
  return r;
}

Result<Tensor> MegatronModel::prefill(Backend& be, const MegatronAxes& axes, const ShardedWeights& w,
                                      const Tensor& ids, KvCache& cache, double* exposed_comm_seconds) const {
  if (seq_par_ || sp_degree() != 1)
    return invalid_argument("prefill runs plain tensor parallelism (sp degree 1, not sequence-parallel)");
  if (options_.dtype != DType::kF32)
    return unimplemented("prefill of {}: generation's KV cache is f32; drop :bf16", options_.to_string());
  if (ids.rank() != 2 || ids.dtype() != DType::kI32 || ids.dim(1) != shard_.seq())
    return invalid_argument("prefill ids {}: expected i32 [B, {}]", ids.describe(), shard_.seq());
  // No head: the targets are never read.
  MegatronStep step(*this, be, axes, Batch{ids, ids}, TpStepInputs{&w, nullptr, 0, false, false});
  step.set_kv_cache(&cache);
  Tensor x = forward_blocks(step, config_.num_hidden_layers, step.embed_forward());
  if (exposed_comm_seconds != nullptr) *exposed_comm_seconds += step.blocked_seconds();
  return x;
}

Result<Tensor> MegatronModel::prefill_stage(Backend& be, const MegatronAxes& axes, const ShardedWeights& w,
                                            const Tensor& ids, const StageLayers& stage, Tensor x, KvCache& cache,
                                            double* exposed_comm_seconds) const {
  if (seq_par_ || sp_degree() != 1)
    return invalid_argument("prefill runs plain tensor parallelism (sp degree 1, not sequence-parallel)");
  if (options_.dtype != DType::kF32)
    return unimplemented("prefill of {}: generation's KV cache is f32; drop :bf16", options_.to_string());
  if (ids.rank() != 2 || ids.dtype() != DType::kI32 || ids.dim(1) != shard_.seq())
    return invalid_argument("prefill ids {}: expected i32 [B, {}]", ids.describe(), shard_.seq());
  MegatronStep step(*this, be, axes, Batch{ids, ids}, TpStepInputs{&w, nullptr, 0, false, false});
  step.set_kv_cache(&cache);
  if (stage.embed) x = step.embed_forward();
  const int64_t end = stage.end < 0 ? config_.num_hidden_layers : stage.end;
  for (int64_t l = stage.first; l < end; ++l) x = step.block_forward(l, x, false);
  if (exposed_comm_seconds != nullptr) *exposed_comm_seconds += step.blocked_seconds();
  return x;
}

}  // namespace foldpar
