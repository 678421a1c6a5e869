// MegatronModel: validation, the flat gradient buffer, and one step: the order of
// run_tp_step (parallel/megatron/tp_step_base.h), then the sums of the step's partial
// gradients; and generation's prefill.
#include "parallel/megatron/megatron_model.h"

#include "parallel/megatron/megatron_step.h"

namespace foldpar {

using megatron_detail::MegatronStep;
using megatron_detail::run_tp_blocks;
using megatron_detail::run_tp_step;

MegatronGrads MegatronGrads::allocate(const LlamaConfig& c, const ShardDims& dims, int owner, MemCategory category) {
  const int64_t L = c.num_hidden_layers, h = dims.h;
  const bool tied = c.tie_word_embeddings;
  const int64_t total =
      L * (dims.attn_elems() + dims.mlp_elems()) + (tied ? 1 : 2) * dims.vocab_elems() + (2 * L + 1) * h;
  MegatronGrads g;
  g.flat_ = Tensor::empty({total}, DType::kF32, category);
  int64_t offset = 0;
  auto take = [&](const Shape& shape) {
    Tensor t = g.flat_.narrow(offset, offset + shape.numel()).reshape(shape);
    offset += shape.numel();
    return t;
  };
  // ShardedWeights::for_each's order: the sharded tensors, then the gains, contiguous.
  ShardedWeights& w = g.views_;
  w.dims = dims;
  w.owner = owner;
  w.tied = tied;
  for (int64_t l = 0; l < L; ++l) {
    w.attn.push_back(take({dims.attn_rows(), h}));
    w.mlp.push_back(take({dims.mlp_rows(), h}));
  }
  w.embed = take({dims.v_rows, h});
  w.lm_head = tied ? w.embed : take({dims.v_rows, h});
  g.norm_offset_ = offset;
  for (int64_t l = 0; l < L; ++l) {
    w.attn_norm.push_back(take({h}));
    w.mlp_norm.push_back(take({h}));
  }
  w.final_norm = take({h});
  FP_CHECK(offset == total, "flat TP x SP gradients: {} of {} elements laid out", offset, total);
  return g;
}

// Host zeroing, as ShardedWeights::zero (zero_grads takes no Backend yet).
void MegatronGrads::zero() {
  flat_.zero();
  known_zero_ = true;
}

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
                                            int64_t seq) {
  FP_CHECK(layout.strategy == Strategy::kMegatron, "MegatronModel for layout {}", layout.to_string());
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, seq));
  if (layout.dtype != DType::kF32)
    return unimplemented("this layout stores weights and activations in f32 only; bf16 storage runs under tsp");
  const int T = layout.tp, P = layout.sp;
  FP_CHECK(t >= 0 && t < T && p >= 0 && p < P, "rank ({}, {}) of layout {}", t, p, layout.to_string());
  FP_ASSIGN_OR_RETURN(ShardDims dims, shard_dims(config, T, "tp"));
  // One sp rank holds every position in order, whatever the split.
  const SeqSplit split = P == 1 ? SeqSplit::kContiguous : layout.split;
  FP_ASSIGN_OR_RETURN(SequenceShard shard, SequenceShard::create(seq, P, p, split));
  return MegatronModel(config, dims, t, std::move(shard), layout);
}

Batch MegatronModel::local_batch(const Batch& global) const {
  FP_CHECK(global.seq() == shard_.seq(), "batch of S={} for a model of S={}", global.seq(), shard_.seq());
  if (local_seq() == shard_.seq()) return global;  // every position, in order: the global batch itself
  return batch_rows_at(global, positions_);
}

void MegatronModel::scatter_rows(const Tensor& local, Tensor& global) const {
  FP_CHECK(global.dim(1) == shard_.seq(), "scatter of {} into {}", local.describe(), global.describe());
  scatter_rows_to(local, positions_, global);
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

Result<StepResult> MegatronModel::forward(Backend& be, const MegatronAxes& axes, const ShardedWeights& w,
                                      const Batch& batch) const {
  FP_RETURN_IF_ERROR(check_local_batch(be, *this, batch));
  MegatronStep step(*this, be, axes, batch);
  StepResult r = run_tp_step(step, options_.recompute, options_.keep_logits, w, nullptr, 0);
  r.exposed_comm_seconds = step.blocked_seconds();
  return r;
}

Result<StepResult> MegatronModel::forward_backward(Backend& be, const MegatronAxes& axes, const ShardedWeights& w,
                                                   const Batch& batch, MegatronGrads& grads,
                                                   int64_t loss_normalizer) const {
  FP_RETURN_IF_ERROR(check_local_batch(be, *this, batch));
  MegatronStep step(*this, be, axes, batch);
  // Over sp only this step's partial is summed: it accumulates straight into gradients known
  // to be zero, otherwise into a scratch buffer added afterwards. With one sp rank nothing
  // is summed over sp and the step accumulates into the gradients themselves.
  const bool in_place = sp_degree() == 1 || grads.known_zero();
  MegatronGrads scratch;
  if (!in_place) {
    scratch = MegatronGrads::allocate(config_, dims_, tp_rank_, MemCategory::kGradients);
    be.fill(0.0, scratch.flat());
  }
  MegatronGrads& partial = in_place ? grads : scratch;

  StepResult r = run_tp_step(step, options_.recompute, options_.keep_logits, w, &partial.views(), loss_normalizer);
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
  if (ids.rank() != 2 || ids.dtype() != DType::kI32 || ids.dim(1) != shard_.seq())
    return invalid_argument("prefill ids {}: expected i32 [B, {}]", ids.describe(), shard_.seq());
  MegatronStep step(*this, be, axes, Batch{ids, ids});  // no head: the targets are never read
  step.set_kv_cache(&cache);
  Tensor x = step.embed(w);
  x = run_tp_blocks(step, options_.recompute, w, x, nullptr);
  if (exposed_comm_seconds != nullptr) *exposed_comm_seconds += step.blocked_seconds();
  return x;
}

}  // namespace foldpar
