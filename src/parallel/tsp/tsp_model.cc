// TspModel: validation and the order of one TSP step (embedding ring, L blocks of
// broadcast attention + ring MLP, the vocabulary-sharded head and loss, then the adjoint in
// reverse).
#include "parallel/tsp/tsp_model.h"

#include "parallel/tsp/tsp_step.h"

namespace foldpar {

using tsp_detail::HeadSaved;
using tsp_detail::LayerSaved;
using tsp_detail::TspStep;

Result<TspModel> TspModel::create(const LlamaConfig& config, const Layout& layout, int rank, int64_t seq) {
  FP_CHECK(layout.strategy == Strategy::kTsp, "TspModel for layout {}", layout.to_string());
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, seq));
  FP_ASSIGN_OR_RETURN(ShardDims dims, shard_dims(config, layout.tsp, "TSP"));
  FP_ASSIGN_OR_RETURN(SequenceShard shard, SequenceShard::create(seq, layout.tsp, rank, layout.split));
  return TspModel(config, dims, std::move(shard), layout);
}

namespace {

Status check_local_batch(const TspModel& m, const Batch& b) {
  FP_RETURN_IF_ERROR(validate_batch(m.config(), b));
  if (b.seq() != m.shard().local_seq())
    return invalid_argument("local batch has {} tokens per sequence, the TSP shard holds {} (S {} / D {})", b.seq(),
                            m.shard().local_seq(), m.shard().seq(), m.shard().degree());
  return Status();
}

// The forward of every block; `saved` receives per-layer activations (all of them, or
// only the block inputs under Recompute::kBlock).
Tensor run_blocks(TspStep& step, const TspModel& m, const ShardedWeights& w, Tensor x, std::vector<LayerSaved>* saved) {
  const bool keep = m.options().recompute == Recompute::kNone;
  for (size_t l = 0; l < w.attn.size(); ++l) {
    LayerSaved* s = saved != nullptr && keep ? &(*saved)[l] : nullptr;
    if (saved != nullptr && !keep) (*saved)[l].attn.x_in = x;
    Tensor x_mid = step.attention_forward(static_cast<int>(l), w, x, s != nullptr ? &s->attn : nullptr);
    x = step.mlp_forward(static_cast<int>(l), w, x_mid, s != nullptr ? &s->mlp : nullptr);
  }
  return x;
}

}  // namespace

Result<StepResult> TspModel::forward(Backend& be, Communicator& tsp, const ShardedWeights& w, const Batch& batch) const {
  FP_RETURN_IF_ERROR(check_local_batch(*this, batch));
  TspStep step(*this, be, tsp, batch.batch());
  const int64_t T = batch.input_ids.numel();
  Tensor x = step.embed(w, batch.input_ids.reshape({T}));
  x = run_blocks(step, *this, w, x, nullptr);
  HeadSaved hs;
  Tensor logits;
  StepResult r = step.head_forward(w, x, batch.target_ids.reshape({T}), hs, options_.keep_logits ? &logits : nullptr);
  if (options_.keep_logits) r.logits = logits.reshape({batch.batch(), batch.seq(), config_.vocab_size});
  r.exposed_comm_seconds = step.wait_seconds();
  return r;
}

Result<Tensor> TspModel::prefill(Backend& be, Communicator& tsp, const ShardedWeights& w, const Tensor& ids,
                                 KvCache& cache, double* exposed_comm_seconds) const {
  if (ids.rank() != 2 || ids.dtype() != DType::kI32 || ids.dim(1) != shard_.local_seq())
    return invalid_argument("prefill ids {}: expected i32 [B, {}] (S {} / D {})", ids.describe(), shard_.local_seq(),
                            shard_.seq(), shard_.degree());
  TspStep step(*this, be, tsp, ids.dim(0));
  step.set_kv_cache(&cache);
  Tensor x = step.embed(w, ids.reshape({ids.numel()}));
  x = run_blocks(step, *this, w, x, nullptr);
  if (exposed_comm_seconds != nullptr) *exposed_comm_seconds += step.wait_seconds();
  return x;
}

Result<StepResult> TspModel::forward_backward(Backend& be, Communicator& tsp, const ShardedWeights& w,
                                              const Batch& batch, ShardedWeights& g, int64_t loss_normalizer) const {
  FP_RETURN_IF_ERROR(check_local_batch(*this, batch));
  TspStep step(*this, be, tsp, batch.batch());
  const int64_t T = batch.input_ids.numel();
  const Tensor ids = batch.input_ids.reshape({T}), targets = batch.target_ids.reshape({T});
  const size_t L = w.attn.size();
  std::vector<LayerSaved> saved(L);

  Tensor x = step.embed(w, ids);
  x = run_blocks(step, *this, w, x, &saved);
  HeadSaved hs;
  Tensor logits;
  StepResult r = step.head_forward(w, x, targets, hs, options_.keep_logits ? &logits : nullptr);
  if (options_.keep_logits) r.logits = logits.reshape({batch.batch(), batch.seq(), config_.vocab_size});
  x = Tensor();

  Tensor dx = step.head_backward(w, hs, targets, loss_normalizer > 0 ? loss_normalizer : r.valid_tokens, g);
  hs = HeadSaved();
  for (size_t l = L; l-- > 0;) {
    LayerSaved& s = saved[l];
    if (options_.recompute == Recompute::kBlock) {
      const Tensor x_in = s.attn.x_in;
      Tensor x_mid = step.attention_forward(static_cast<int>(l), w, x_in, &s.attn);
      Tensor out = step.mlp_forward(static_cast<int>(l), w, x_mid, &s.mlp);
    }
    dx = step.mlp_backward(static_cast<int>(l), w, s.mlp, dx, g);
    dx = step.attention_backward(static_cast<int>(l), w, s.attn, dx, g);
    s = LayerSaved();
  }
  step.embed_backward(ids, dx, g);
  step.sum_norm_partials(g);
  r.exposed_comm_seconds = step.wait_seconds();
  return r;
}

}  // namespace foldpar
