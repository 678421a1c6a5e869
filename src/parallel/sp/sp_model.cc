// SpModel: validation, the flat gradient buffer, and the order of one SP step (embedding,
// L blocks, head and loss, then the backward in reverse and the gradient all-reduce).
#include "parallel/sp/sp_model.h"

#include "parallel/sp/sp_step.h"

namespace foldpar {

using sp_detail::HeadSaved;
using sp_detail::LayerSaved;
using sp_detail::SpStep;

SpGrads SpGrads::allocate(const LlamaConfig& c, MemCategory category) {
  const int64_t h = c.hidden_size, f = c.intermediate_size, q = c.num_attention_heads * c.head_dim(),
                kv = c.kv_dim(), V = c.vocab_size;
  SpGrads g;
  g.flat_ = Tensor::empty({c.parameter_count()}, DType::kF32, category);
  int64_t offset = 0;
  auto take = [&](const Shape& shape) {
    Tensor t = g.flat_.narrow(offset, offset + shape.numel()).reshape(shape);
    offset += shape.numel();
    return t;
  };
  // State-dict order, as LlamaWeights::allocate shapes them.
  LlamaWeights& w = g.views_;
  w.tied = c.tie_word_embeddings;
  w.embed = take({V, h});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights lw;
    lw.attn_norm = take({h});
    lw.wq = take({q, h});
    lw.wk = take({kv, h});
    lw.wv = take({kv, h});
    lw.wo = take({h, q});
    lw.mlp_norm = take({h});
    lw.w_gate = take({f, h});
    lw.w_up = take({f, h});
    lw.w_down = take({h, f});
    w.layers.push_back(std::move(lw));
  }
  w.final_norm = take({h});
  w.lm_head = w.tied ? w.embed : take({V, h});
  FP_CHECK(offset == g.flat_.numel(), "flat gradients: {} of {} elements laid out", offset, g.flat_.numel());
  return g;
}

void SpGrads::zero() {
  flat_.zero();
  known_zero_ = true;
}

Result<SpModel> SpModel::create(const LlamaConfig& config, int degree, int rank, int64_t seq,
                                const SpOptions& options) {
  FP_RETURN_IF_ERROR(config.validate());
  FP_ASSIGN_OR_RETURN(SequenceShard shard, SequenceShard::create(seq, degree, rank, options.split));
  return SpModel(config, std::move(shard), options);
}

namespace {

Status check_local_batch(const SpModel& m, const Batch& b) {
  FP_RETURN_IF_ERROR(validate_batch(m.config(), b));
  if (b.seq() != m.shard().local_seq())
    return invalid_argument("local batch has {} tokens per sequence, the SP shard holds {} (S {} / sp degree {})", b.seq(),
                            m.shard().local_seq(), m.shard().seq(), m.shard().degree());
  return Status();
}

}  // namespace

Result<StepResult> SpModel::forward(Backend& be, Communicator& sp, const LlamaWeights& w, const Batch& batch) const {
  FP_RETURN_IF_ERROR(check_local_batch(*this, batch));
  SpStep step(*this, be, sp, batch.batch());
  const int64_t T = batch.input_ids.numel();
  Tensor x = step.embed(w, batch.input_ids.reshape({T}));
  for (const LayerWeights& lw : w.layers) x = step.block_forward(lw, x, nullptr, false);
  HeadSaved hs;
  StepResult r = step.head_forward(w, x, batch.target_ids.reshape({T}), hs, options_.keep_logits);
  if (options_.keep_logits) r.logits = r.logits.reshape({batch.batch(), batch.seq(), config_.vocab_size});
  r.exposed_comm_seconds = step.wait_seconds();
  return r;
}

Result<StepResult> SpModel::forward_backward(Backend& be, Communicator& sp, const LlamaWeights& w, const Batch& batch,
                                             SpGrads& grads, int64_t loss_normalizer) const {
  FP_RETURN_IF_ERROR(check_local_batch(*this, batch));
  SpStep step(*this, be, sp, batch.batch());
  const int64_t T = batch.input_ids.numel();
  const Tensor ids = batch.input_ids.reshape({T}), targets = batch.target_ids.reshape({T});
  const size_t L = w.layers.size();
  const bool keep = options_.recompute == Recompute::kNone;
  // Only this step's partial is summed over the axis: it accumulates straight into gradients
  // known to be zero, otherwise into a scratch buffer added afterwards.
  const bool in_place = grads.known_zero();
  SpGrads scratch;
  if (!in_place) {
    scratch = SpGrads::allocate(config_, MemCategory::kGradients);
    scratch.zero();
  }
  SpGrads& partial = in_place ? grads : scratch;
  LlamaWeights& g = partial.views();

  // Forward. Under Recompute::kBlock only each block's input is kept.
  std::vector<LayerSaved> saved(L);
  Tensor x = step.embed(w, ids);
  for (size_t l = 0; l < L; ++l) {
    if (!keep) saved[l].x_in = x;
    x = step.block_forward(w.layers[l], x, keep ? &saved[l] : nullptr, false);
  }
  HeadSaved hs;
  StepResult r = step.head_forward(w, x, targets, hs, options_.keep_logits);
  if (options_.keep_logits) r.logits = r.logits.reshape({batch.batch(), batch.seq(), config_.vocab_size});
  x = Tensor();

  // Backward, the blocks in reverse; a recomputed all-gather block keeps its gathered K/V
  // for the backward that follows at once.
  Tensor dx = step.head_backward(w, hs, targets, loss_normalizer > 0 ? loss_normalizer : r.valid_tokens, g);
  hs = HeadSaved();
  const bool keep_gathered = options_.kv_exchange == LayoutOptions::KvExchange::kAllGather;
  for (size_t l = L; l-- > 0;) {
    if (!keep) {
      const Tensor x_in = saved[l].x_in;
      Tensor out = step.block_forward(w.layers[l], x_in, &saved[l], keep_gathered);
    }
    dx = step.block_backward(w.layers[l], saved[l], dx, g.layers[l]);
    saved[l] = LayerSaved();
  }
  step.embed_backward(ids, dx, g);
  dx = Tensor();

  // The replicated weights' gradient: every rank's partial summed over the axis.
  step.all_reduce_grads(partial.flat());
  if (!in_place) be.add_inplace(scratch.flat(), grads.flat());
  grads.mark_written();
  r.exposed_comm_seconds = step.wait_seconds();
  return r;
}

}  // namespace foldpar
