// Tensor-parallel embedding, final norm, LM head and loss, all over vocabulary shards
// (parallel/tensor_parallel.h):
//   embedding  fwd: local rows, then g (all_reduce) or g' (reduce_scatter to this rank's
//              rows); bwd: dX of every token (g^T: identity, or all_gather) scattered into
//              this rank's vocabulary rows, no other communication.
//   head       fwd: xf = norm(x) on this rank's rows, f' (all_gather) with sequence
//              parallelism; the vocabulary-parallel cross-entropy on every token; bwd: the
//              partial d_xf through f^T (all_reduce, or reduce_scatter) while the LM head's
//              weight gradient computes. The loss is the same on every rank: no reduction.
#include "parallel/tp/tp_step.h"

namespace foldpar::tp_detail {

Tensor TpStep::embed(const ShardedWeights& w) {
  Tensor partial = sp_ ? comm_buffer({all_rows_, dims_.h}) : act({all_rows_, dims_.h});
  embedding_partial(be_, tp_.rank(), ids_, w.embed, partial);
  return reduce_rows(partial);  // fwd: g or g'
}

void TpStep::embed_backward(const Tensor& dx, ShardedWeights& grads) {
  const Tensor dx_full = gather_rows(dx);  // bwd of g: identity; of g': all_gather
  be_.embedding_backward(ids_, dx_full, tp_.rank() * dims_.v_rows, grads.embed);
}

StepResult TpStep::head_forward(const ShardedWeights& w, const Tensor& x, HeadSaved& hs, Tensor* logits) {
  const int64_t R = rows_, h = dims_.h;
  hs.x_last = x;
  hs.rstd = act({R});
  Tensor xf = act({R, h});
  be_.rmsnorm_forward(x, w.final_norm, c_.rms_norm_eps, xf, hs.rstd);
  // Kept for the head's weight gradient (one [N, h]; the local logits kept beside it are
  // [N, V/T]), rather than gathered again in backward.
  hs.xf_full = gather_rows(xf);  // fwd: f or f'
  hs.loss = vocab_parallel_cross_entropy(tp_, hs.xf_full, w.lm_head, targets_);
  if (logits != nullptr) {  // verification only: this rank's rows, every column
    std::vector<int64_t> rows;
    const int64_t Sl = model_.local_seq(), first = sp_ ? tp_.rank() * Sl : 0;
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t i = 0; i < Sl; ++i) rows.push_back(b * seq_ + first + i);
    *logits = gather_vocab_logits(tp_, hs.loss.logits, rows);
  }
  StepResult r;
  r.loss_sum = hs.loss.loss_sum;
  r.valid_tokens = hs.loss.valid_tokens;
  r.loss = r.valid_tokens > 0 ? r.loss_sum / static_cast<double>(r.valid_tokens) : 0.0;
  return r;
}

Tensor TpStep::head_backward(const ShardedWeights& w, HeadSaved& hs, int64_t valid_tokens, ShardedWeights& grads) {
  const int64_t R = rows_, h = dims_.h;
  const double scale = valid_tokens > 0 ? 1.0 / static_cast<double>(valid_tokens) : 0.0;
  Tensor d_xf_partial = sp_ ? comm_buffer({all_rows_, h}) : act({all_rows_, h});
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

}  // namespace foldpar::tp_detail
