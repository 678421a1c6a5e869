// TpStepBase: construction, the row mappings over tp, the vocabulary-parallel embedding,
// head and loss, and the order of a step (parallel/megatron/tp_step_base.h).
//   embedding  fwd: local vocabulary rows, then g (all_reduce) or g' (reduce_scatter to this
//              rank's rows); bwd: dX of every row (g^T: identity, or all_gather) scattered
//              into this rank's vocabulary rows, no other communication.
//   head       fwd: xf = norm(x) on this rank's rows, f' (all_gather) with sequence
//              parallelism; the vocabulary-parallel cross-entropy on every row; bwd: the
//              partial d_xf through f^T (all_reduce, or reduce_scatter) while the LM head's
//              weight gradient computes.
#include "parallel/megatron/tp_step_base.h"

namespace foldpar::megatron_detail {

TpStepBase::TpStepBase(const LlamaConfig& config, const ShardDims& dims, Backend& backend, Communicator& tp,
                       int tp_rank, bool overlap, bool sequence_parallel, TpRows rows, const Batch& local)
    : c_(config),
      dims_(dims),
      be_(backend),
      tp_(tp, backend, overlap),
      seq_par_(sequence_parallel),
      batch_(rows.batch),
      tp_seq_(rows.tp_seq),
      local_seq_(rows.local_seq),
      rows_(rows.batch * rows.local_seq),
      all_rows_(rows.batch * rows.tp_seq) {
  FP_CHECK(tp.size() == dims_.degree && tp.rank() == tp_rank, "tp rank {} of {} on communicator {}", tp_rank,
           dims_.degree, tp.describe());
  if (seq_par_) {
    // Every tp rank needs every row's ids (vocabulary-parallel embedding) and targets (the
    // loss runs on every row): one all_gather of both, packed [B, local, 2] -> [B, tp_seq, 2].
    Tensor packed = Tensor::empty({batch_, local_seq_, 2}, DType::kI32, MemCategory::kActivations);
    Tensor full = Tensor::empty({batch_, tp_seq_, 2}, DType::kI32, MemCategory::kActivations);
    // Interleaved: ids at the even elements, targets at the odd ones.
    be_.copy_strided(local.input_ids, packed, {rows_, 1, {0, 1}, {0, 2}});
    be_.copy_strided(local.target_ids, packed, {rows_, 1, {0, 1}, {1, 2}});
    tp_.all_gather_seq(packed, full);
    ids_ = Tensor::empty({all_rows_}, DType::kI32, MemCategory::kActivations);
    targets_ = Tensor::empty({all_rows_}, DType::kI32, MemCategory::kActivations);
    be_.copy_strided(full, ids_, {all_rows_, 1, {0, 2}, {0, 1}});
    be_.copy_strided(full, targets_, {all_rows_, 1, {1, 2}, {0, 1}});
  } else {
    ids_ = local.input_ids.reshape({all_rows_});
    targets_ = local.target_ids.reshape({all_rows_});
  }
}

// ---- the row mappings ----

TpComm::Pending TpStepBase::start_gather_rows(const Tensor& local, Tensor& full) {
  const int64_t h = dims_.h;
  Tensor f = full.reshape({batch_, tp_seq_, h});
  return tp_.start_all_gather_seq(local.reshape({batch_, local_seq_, h}), f);
}

Tensor TpStepBase::gather_rows(const Tensor& local) {
  if (!seq_par_) return local;  // f: identity
  Tensor full = comm_buffer({all_rows_, dims_.h});
  TpComm::Pending p = start_gather_rows(local, full);
  tp_.wait(p);
  return full;
}

TpComm::Pending TpStepBase::start_reduce_rows(Tensor& partial, Tensor& out) {
  if (!seq_par_) {
    out = partial;
    if (tp_.size() == 1) return TpComm::Pending{};  // one rank's partial is the sum
    return tp_.start_all_reduce(partial);          // g: all_reduce in place
  }
  const int64_t h = dims_.h;
  out = act({rows_, h});
  Tensor o = out.reshape({batch_, local_seq_, h});
  return tp_.start_reduce_scatter_seq(partial.reshape({batch_, tp_seq_, h}), o);
}

Tensor TpStepBase::reduce_rows(Tensor& partial) {
  Tensor out;
  TpComm::Pending p = start_reduce_rows(partial, out);
  tp_.wait(p);
  return out;
}

Tensor& TpStepBase::norm_grad(Tensor& grad, int /*index*/) { return grad; }

// ---- embedding, head and loss ----

Tensor TpStepBase::embed(const ShardedWeights& w) {
  Tensor partial = seq_par_ ? comm_buffer({all_rows_, dims_.h}) : act({all_rows_, dims_.h});
  embedding_partial(be_, tp_.rank(), ids_, w.embed, partial);
  return reduce_rows(partial);  // fwd: g or g'
}

void TpStepBase::embed_backward(const Tensor& dx, ShardedWeights& grads) {
  const Tensor dx_full = gather_rows(dx);  // bwd of g: identity; of g': all_gather
  be_.embedding_backward(ids_, dx_full, tp_.rank() * dims_.v_rows, grads.embed);
}

StepResult TpStepBase::head_forward(const ShardedWeights& w, const Tensor& x, HeadSaved& hs, Tensor* logits) {
  const int64_t R = rows_, h = dims_.h;
  hs.x_last = x;
  hs.rstd = act({R});
  Tensor xf = act({R, h});
  be_.rmsnorm_forward(x, w.final_norm, c_.rms_norm_eps, xf, hs.rstd);
  // Kept for the head's weight gradient (one [N, h]; the local logits kept beside it are
  // [N, V/tp]), rather than gathered again in backward.
  hs.xf_full = gather_rows(xf);  // fwd: f or f'
  hs.loss = vocab_parallel_cross_entropy(tp_, hs.xf_full, w.lm_head, targets_);
  if (logits != nullptr) {  // verification only: this rank's rows, every column
    std::vector<int64_t> rows;
    const int64_t first = seq_par_ ? tp_.rank() * local_seq_ : 0;
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t i = 0; i < local_seq_; ++i) rows.push_back(b * tp_seq_ + first + i);
    *logits = gather_vocab_logits(tp_, hs.loss.logits, rows).reshape({batch_, local_seq_, c_.vocab_size});
  }
  StepResult r;
  r.loss_sum = hs.loss.loss_sum;
  r.valid_tokens = hs.loss.valid_tokens;
  r.loss = r.valid_tokens > 0 ? r.loss_sum / static_cast<double>(r.valid_tokens) : 0.0;
  return r;
}

Tensor TpStepBase::head_backward(const ShardedWeights& w, HeadSaved& hs, int64_t normalizer, ShardedWeights& grads) {
  const int64_t R = rows_, h = dims_.h;
  const double scale = normalizer > 0 ? 1.0 / static_cast<double>(normalizer) : 0.0;
  Tensor d_xf_partial = seq_par_ ? comm_buffer({all_rows_, h}) : act({all_rows_, h});
  vocab_parallel_cross_entropy_backward(be_, tp_.rank(), hs.loss, w.lm_head, targets_, scale, d_xf_partial);
  Tensor d_xf;
  TpComm::Pending req = start_reduce_rows(d_xf_partial, d_xf);  // bwd of f: all_reduce; of f': reduce_scatter
  vocab_parallel_head_weight_grad(be_, hs.loss, hs.xf_full, grads.lm_head);
  tp_.wait(req);
  hs.loss = VocabParallelLoss();
  hs.xf_full = Tensor();
  Tensor dx = act({R, h});
  be_.rmsnorm_backward(hs.x_last, w.final_norm, hs.rstd, d_xf, dx,
                       norm_grad(grads.final_norm, 2 * static_cast<int>(c_.num_hidden_layers)));
  return dx;
}

// ---- the order of a step ----

Tensor run_tp_blocks(TpStepBase& step, Recompute recompute, const ShardedWeights& w, Tensor x,
                     std::vector<LayerSaved>* saved) {
  const bool keep = recompute == Recompute::kNone;
  for (size_t l = 0; l < w.attn.size(); ++l) {
    LayerSaved* s = saved != nullptr && keep ? &(*saved)[l] : nullptr;
    if (saved != nullptr && !keep) (*saved)[l].attn.x_in = x;
    const int layer = static_cast<int>(l);
    Tensor x_mid = step.attention_forward(layer, w, x, s != nullptr ? &s->attn : nullptr, false);
    x = step.mlp_forward(layer, w, x_mid, s != nullptr ? &s->mlp : nullptr, false);
  }
  return x;
}

StepResult run_tp_step(TpStepBase& step, Recompute recompute, bool keep_logits, const ShardedWeights& w,
                       ShardedWeights* grads, int64_t loss_normalizer) {
  const size_t L = w.attn.size();
  std::vector<LayerSaved> saved(grads != nullptr ? L : 0);
  Tensor x = step.embed(w);
  x = run_tp_blocks(step, recompute, w, x, grads != nullptr ? &saved : nullptr);
  HeadSaved hs;
  Tensor logits;
  StepResult r = step.head_forward(w, x, hs, keep_logits ? &logits : nullptr);
  if (keep_logits) r.logits = logits;
  if (grads == nullptr) return r;
  x = Tensor();

  Tensor dx = step.head_backward(w, hs, loss_normalizer > 0 ? loss_normalizer : r.valid_tokens, *grads);
  hs = HeadSaved();
  for (size_t l = L; l-- > 0;) {
    LayerSaved& s = saved[l];
    const int layer = static_cast<int>(l);
    if (recompute == Recompute::kBlock) {
      // The rerun keeps what it gathered (norm outputs, K/V): backward follows at once.
      const Tensor x_in = s.attn.x_in;
      Tensor x_mid = step.attention_forward(layer, w, x_in, &s.attn, true);
      Tensor out = step.mlp_forward(layer, w, x_mid, &s.mlp, true);
    }
    dx = step.mlp_backward(layer, w, s.mlp, dx, *grads);
    dx = step.attention_backward(layer, w, s.attn, dx, *grads);
    s = LayerSaved();
  }
  step.embed_backward(dx, *grads);
  return r;
}

}  // namespace foldpar::megatron_detail
