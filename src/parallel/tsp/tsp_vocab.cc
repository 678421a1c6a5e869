// TSP embedding, LM head and loss over vocabulary shards travelling the ring (spec 3).
// The LM head never forms the [T, V] logits: each visiting shard updates a running max,
// sum of exponentials and target logit per token (online log-sum-exp); the backward
// rotates the shards once more to form softmax minus one-hot per shard. Gradients of both
// go home on the gradient ring.
#include <chrono>
#include <cmath>

#include "parallel/tsp/tsp_step.h"

namespace foldpar::tsp_detail {

Tensor TspStep::embed(const ShardedWeights& w, const Tensor& ids) {
  Tensor x = act({rows_, dims_.h});
  WeightRing ring = weight_ring(w.embed);
  for (int j = 0; j < D_; ++j) {
    weight_ring_send(ring, j);
    // Every id lies in exactly one shard, so after D steps every row is written.
    be_.embedding_forward(ids, ring.cur, ring_owner(j) * dims_.v_rows, x);
    weight_ring_advance(ring, j);
  }
  return x;
}

void TspStep::embed_backward(const Tensor& ids, const Tensor& dx, ShardedWeights& grads) {
  // No weights needed: only the gradient trip home.
  GradRing gring = grad_ring(comm_);
  for (int j = 0; j < D_; ++j) {
    Tensor partial = grad_ring_partial(grads.embed, j, {dims_.v_rows, dims_.h});
    if (j > 0) be_.fill(0.0, partial);
    be_.embedding_backward(ids, dx, ring_owner(j) * dims_.v_rows, partial);
    grad_ring_send(gring, j, partial);
  }
  grad_ring_finish(gring, grads.embed);
}

StepResult TspStep::head_forward(const ShardedWeights& w, const Tensor& x, const Tensor& targets, HeadSaved& hs,
                                 Tensor* logits) {
  const int64_t T = rows_, h = dims_.h, vr = dims_.v_rows;
  hs.x_last = x;
  hs.rstd = stat({T});
  hs.xf = act({T, h});
  be_.rmsnorm_forward(x, w.final_norm, c_.rms_norm_eps, hs.xf, hs.rstd);
  Tensor row_max = stat({T}), row_sum = stat({T}), target_logit = stat({T});
  be_.fill(-INFINITY, row_max);
  be_.fill(0.0, row_sum);
  be_.fill(0.0, target_logit);
  if (logits != nullptr) *logits = stat({T, c_.vocab_size});  // verification only, f32
  WeightRing ring = weight_ring(w.lm_head);
  for (int j = 0; j < D_; ++j) {
    weight_ring_send(ring, j);
    Tensor chunk = act({T, vr});
    be_.matmul(hs.xf, false, ring.cur, true, chunk);
    const int64_t offset = ring_owner(j) * vr;
    be_.softmax_chunk_update(chunk, targets, offset, kIgnoreIndex, row_max, row_sum, target_logit);
    if (logits != nullptr) {  // verification only
      Tensor c32 = chunk;
      if (chunk.dtype() != DType::kF32) {
        c32 = Tensor::empty(chunk.shape(), DType::kF32, MemCategory::kWorkspace);
        be_.copy(chunk, c32);
      }
      be_.copy_strided(c32, *logits, {T, vr, {0, vr}, {offset, c_.vocab_size}});
    }
    weight_ring_advance(ring, j);
  }
  // lse and the local loss, then the sums over the axis (two f64 values).
  hs.lse = stat({T});
  const LossSums local = be_.cross_entropy_finish(row_max, row_sum, target_logit, targets, kIgnoreIndex, hs.lse);
  double sums[2] = {local.loss_sum, static_cast<double>(local.valid_tokens)};  // host scalars for the all_reduce
  const auto t0 = std::chrono::steady_clock::now();
  blocking(comm_.all_reduce(sums, sums, 2, DType::kF64, ReduceOp::kSum), t0);
  StepResult r;
  r.loss_sum = sums[0];
  r.valid_tokens = static_cast<int64_t>(sums[1]);
  r.loss = r.valid_tokens > 0 ? r.loss_sum / static_cast<double>(r.valid_tokens) : 0.0;
  return r;
}

Tensor TspStep::head_backward(const ShardedWeights& w, const HeadSaved& hs, const Tensor& targets, int64_t valid_tokens,
                              ShardedWeights& grads) {
  const int64_t T = rows_, h = dims_.h, vr = dims_.v_rows;
  const double scale = valid_tokens > 0 ? 1.0 / static_cast<double>(valid_tokens) : 0.0;
  Tensor d_xf = act({T, h});
  be_.fill(0.0, d_xf);
  WeightRing ring = weight_ring(w.lm_head);
  GradRing gring = grad_ring(comm_);
  for (int j = 0; j < D_; ++j) {
    weight_ring_send(ring, j);
    // logits = xf Whead^T for this shard, again; then softmax - onehot, in place.
    Tensor chunk = act({T, vr});
    be_.matmul(hs.xf, false, ring.cur, true, chunk);
    be_.cross_entropy_backward(chunk, targets, hs.lse, ring_owner(j) * vr, kIgnoreIndex, scale, chunk);
    be_.matmul(chunk, false, ring.cur, false, d_xf, 1.0f, 1.0f);
    Tensor partial = grad_ring_partial(grads.lm_head, j, {vr, h});
    be_.matmul(chunk, true, hs.xf, false, partial, 1.0f, j == 0 ? 1.0f : 0.0f);
    grad_ring_send(gring, j, partial);
    weight_ring_advance(ring, j);
  }
  grad_ring_finish(gring, grads.lm_head);
  Tensor dx = act({T, h});
  be_.rmsnorm_backward(hs.x_last, w.final_norm, hs.rstd, d_xf, dx, norm_partials_.back());
  return dx;
}

}  // namespace foldpar::tsp_detail
