// TpModel: validation and the order of one tensor-parallel step (embedding, L blocks, the
// vocabulary-parallel head and loss, then the adjoint in reverse).
#include "parallel/tp/tp_model.h"

#include "parallel/tp/tp_step.h"

namespace foldpar {

using tp_detail::HeadSaved;
using tp_detail::LayerSaved;
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

// Every block's forward; `saved` receives per-layer activations (all of them, or only the
// block inputs under Recompute::kBlock).
Tensor run_blocks(TpStep& step, const TpModel& m, const ShardedWeights& w, Tensor x, std::vector<LayerSaved>* saved) {
  const bool keep = m.options().recompute == Recompute::kNone;
  for (size_t l = 0; l < w.attn.size(); ++l) {
    LayerSaved* s = saved != nullptr && keep ? &(*saved)[l] : nullptr;
    if (saved != nullptr && !keep) (*saved)[l].attn.x_in = x;
    const int layer = static_cast<int>(l);
    Tensor x_mid = step.attention_forward(layer, w, x, s != nullptr ? &s->attn : nullptr, false);
    x = step.mlp_forward(layer, w, x_mid, s != nullptr ? &s->mlp : nullptr, false);
  }
  return x;
}

}  // namespace

Result<StepResult> TpModel::forward(Backend& be, Communicator& tp, const ShardedWeights& w, const Batch& batch) const {
  FP_RETURN_IF_ERROR(check_local_batch(*this, batch));
  TpStep step(*this, be, tp, batch);
  Tensor x = step.embed(w);
  x = run_blocks(step, *this, w, x, nullptr);
  HeadSaved hs;
  Tensor logits;
  StepResult r = step.head_forward(w, x, hs, options_.keep_logits ? &logits : nullptr);
  if (options_.keep_logits) r.logits = logits.reshape({batch.batch(), batch.seq(), config_.vocab_size});
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
  x = run_blocks(step, *this, w, x, nullptr);
  if (exposed_comm_seconds != nullptr) *exposed_comm_seconds += step.blocked_seconds();
  return x;
}

Result<StepResult> TpModel::forward_backward(Backend& be, Communicator& tp, const ShardedWeights& w,
                                             const Batch& batch, ShardedWeights& g, int64_t loss_normalizer) const {
  FP_RETURN_IF_ERROR(check_local_batch(*this, batch));
  TpStep step(*this, be, tp, batch);
  const size_t L = w.attn.size();
  std::vector<LayerSaved> saved(L);

  Tensor x = step.embed(w);
  x = run_blocks(step, *this, w, x, &saved);
  HeadSaved hs;
  Tensor logits;
  StepResult r = step.head_forward(w, x, hs, options_.keep_logits ? &logits : nullptr);
  if (options_.keep_logits) r.logits = logits.reshape({batch.batch(), batch.seq(), config_.vocab_size});
  x = Tensor();

  Tensor dx = step.head_backward(w, hs, loss_normalizer > 0 ? loss_normalizer : r.valid_tokens, g);
  hs = HeadSaved();
  for (size_t l = L; l-- > 0;) {
    LayerSaved& s = saved[l];
    const int layer = static_cast<int>(l);
    if (options_.recompute == Recompute::kBlock) {
      // The rerun keeps its gathered norm outputs: backward follows at once.
      const Tensor x_in = s.attn.x_in;
      Tensor x_mid = step.attention_forward(layer, w, x_in, &s.attn, true);
      Tensor out = step.mlp_forward(layer, w, x_mid, &s.mlp, true);
    }
    dx = step.mlp_backward(layer, w, s.mlp, dx, g);
    dx = step.attention_backward(layer, w, s.attn, dx, g);
    s = LayerSaved();
  }
  step.embed_backward(dx, g);
  step.sum_norm_partials(g);
  r.exposed_comm_seconds = step.blocked_seconds();
  return r;
}

}  // namespace foldpar
