// TpspModel: validation, the flat gradient buffer, and one TP x SP step: the order of
// run_tp_step (parallel/tp_step_base.h), then the sums of the step's partial gradients.
#include "parallel/tpsp/tpsp_model.h"

#include <cstring>

#include "parallel/tpsp/tpsp_step.h"

namespace foldpar {

using tp_detail::run_tp_step;
using tpsp_detail::TpspStep;

TpspGrads TpspGrads::allocate(const LlamaConfig& c, const ShardDims& dims, int owner, MemCategory category) {
  const int64_t L = c.num_hidden_layers, h = dims.h;
  const bool tied = c.tie_word_embeddings;
  const int64_t total =
      L * (dims.attn_elems() + dims.mlp_elems()) + (tied ? 1 : 2) * dims.vocab_elems() + (2 * L + 1) * h;
  TpspGrads g;
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

void TpspGrads::zero() {
  flat_.zero();
  known_zero_ = true;
}

TpspModel::TpspModel(const LlamaConfig& config, ShardDims dims, int tp_rank, SequenceShard shard,
                     const TpspOptions& options)
    : config_(config), dims_(dims), tp_rank_(tp_rank), shard_(std::move(shard)), options_(options) {
  // This rank's rows: the sp shard's, or with sequence parallelism the tp rank's
  // contiguous block of them.
  const std::vector<int32_t>& all = shard_.positions();
  const int64_t n = options_.sequence_parallel ? shard_.local_seq() / dims_.degree : shard_.local_seq();
  const int64_t first = options_.sequence_parallel ? tp_rank_ * n : 0;
  positions_.assign(all.begin() + first, all.begin() + first + n);
}

Result<TpspModel> TpspModel::create(const LlamaConfig& config, int tp_degree, int tp_rank, int sp_degree, int sp_rank,
                                    int64_t seq, const TpspOptions& options) {
  FP_ASSIGN_OR_RETURN(ShardDims dims, shard_dims(config, tp_degree, "tp"));
  if (tp_rank < 0 || tp_rank >= tp_degree)
    return invalid_argument("tp rank {} outside the tp degree ({})", tp_rank, tp_degree);
  FP_ASSIGN_OR_RETURN(SequenceShard shard, SequenceShard::create(seq, sp_degree, sp_rank, options.split));
  if (options.sequence_parallel && shard.local_seq() % tp_degree != 0)
    return invalid_argument(
        "sequence length ({}) must be divisible by the sp degree x the tp degree ({} x {} = {}) with sequence "
        "parallelism",
        seq, sp_degree, tp_degree, static_cast<int64_t>(sp_degree) * tp_degree);
  return TpspModel(config, dims, tp_rank, std::move(shard), options);
}

Batch TpspModel::local_batch(const Batch& global) const {
  const int64_t B = global.batch(), S = global.seq(), n = local_seq();
  FP_CHECK(S == shard_.seq(), "batch of S={} for a model of S={}", S, shard_.seq());
  Batch out;
  out.input_ids = Tensor::empty({B, n}, DType::kI32, MemCategory::kActivations);
  out.target_ids = Tensor::empty({B, n}, DType::kI32, MemCategory::kActivations);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) {
      out.input_ids.data<int32_t>()[b * n + i] = global.input_ids.data<int32_t>()[b * S + positions_[i]];
      out.target_ids.data<int32_t>()[b * n + i] = global.target_ids.data<int32_t>()[b * S + positions_[i]];
    }
  return out;
}

void TpspModel::scatter_rows(const Tensor& local, Tensor& global) const {
  const int64_t B = global.dim(0), S = shard_.seq(), n = local_seq();
  FP_CHECK(global.dim(1) == S && local.dim(0) == B && local.dim(1) == n && local.dtype() == global.dtype() &&
               local.numel() / (B * n) == global.numel() / (B * S),
           "scatter of {} into {}", local.describe(), global.describe());
  const size_t row_bytes = local.nbytes() / static_cast<size_t>(B * n);
  const auto* src = static_cast<const char*>(local.raw_data());
  auto* dst = static_cast<char*>(global.raw_data());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(dst + (b * S + positions_[i]) * row_bytes, src + (b * n + i) * row_bytes, row_bytes);
}

namespace {

Status check_local_batch(const TpspModel& m, const Batch& b) {
  FP_RETURN_IF_ERROR(validate_batch(m.config(), b));
  if (b.seq() != m.local_seq())
    return invalid_argument("local batch has {} tokens per sequence, the tp x sp rank holds {} (S {} / sp degree {}{})",
                            b.seq(), m.local_seq(), m.shard().seq(), m.shard().degree(),
                            m.options().sequence_parallel ? " / tp degree" : "");
  return Status();
}

}  // namespace

Result<StepResult> TpspModel::forward(Backend& be, const TpspAxes& axes, const ShardedWeights& w,
                                      const Batch& batch) const {
  FP_RETURN_IF_ERROR(check_local_batch(*this, batch));
  TpspStep step(*this, be, axes, batch);
  StepResult r = run_tp_step(step, options_.recompute, options_.keep_logits, w, nullptr, 0);
  r.exposed_comm_seconds = step.blocked_seconds();
  return r;
}

Result<StepResult> TpspModel::forward_backward(Backend& be, const TpspAxes& axes, const ShardedWeights& w,
                                               const Batch& batch, TpspGrads& grads, int64_t loss_normalizer) const {
  FP_RETURN_IF_ERROR(check_local_batch(*this, batch));
  TpspStep step(*this, be, axes, batch);
  // Only this step's partial is summed over the axes: it accumulates straight into gradients
  // known to be zero, otherwise into a scratch buffer added afterwards.
  const bool in_place = grads.known_zero();
  TpspGrads scratch;
  if (!in_place) {
    scratch = TpspGrads::allocate(config_, dims_, tp_rank_, MemCategory::kGradients);
    scratch.zero();
  }
  TpspGrads& partial = in_place ? grads : scratch;
  ShardedWeights& g = partial.views();

  StepResult r = run_tp_step(step, options_.recompute, options_.keep_logits, w, &g, loss_normalizer);
  step.sum_partials(partial);
  if (!in_place) be.add_inplace(scratch.flat(), grads.flat());
  grads.mark_written();
  r.exposed_comm_seconds = step.blocked_seconds();
  return r;
}

}  // namespace foldpar
