// TSP gated MLP (spec 4.2 and 5): the ring schedule and its adjoint around the model's
// MLP column chunk (model/sub_blocks.h).
//   forward, step j = 0..D-1, holding the shard of rank (p - j) mod D:
//     start hop (send cur to p+1, receive the next from p-1)   fwd: weight ring
//     y_p += mlp_forward(chunk of f/D columns)                  (local accumulation)
//   backward: the same weight ring again, plus the gradient ring (bwd of the weight ring)
//   that carries each shard's summed gradient home; under the zero-bubble schedule the
//   products and the gradient ring run later, in W (TspStep::set_weight_grads).
// Llama's mlp_bias (replicated, sharded_weights.h): each chunk takes its owner's columns'
// gate/up bias slices; the down bias rides in step 0's chunk, so each token gets it once.
// Their gradients, over this rank's tokens, go into the per-step partials that
// sum_norm_partials() sums over the axis with the attention variants'.
#include <memory>

#include "parallel/tsp/tsp_step.h"

namespace foldpar::tsp_detail {

Tensor TspStep::mlp_forward(int l, const ShardedWeights& w, const Tensor& x_mid, RingMlpSaved* s) {
  if (s != nullptr) *s = RingMlpSaved();
  NormSaved norm = norm_forward(ctx_, w.mlp_norm[l], x_mid);  // a2 [T, h]
  Tensor y = residual_forward(ctx_, x_mid);                    // [T, h]
  WeightRing ring = weight_ring(w.mlp[l]);
  // MPI progresses only inside MPI calls: advance the hop between the chunk's GEMMs.
  const auto progress = [&ring] {
    bool done = false;
    if (ring.hop.pending()) FP_CHECK_OK(ring.hop.test(&done));
  };
  for (int j = 0; j < D_; ++j) {
    weight_ring_send(ring, j);
    foldpar::MlpSaved chunk;  // gate, up, act [T, f/D]
    foldpar::mlp_forward(ctx_, mlp_chunk(ring.cur, w, l, j), norm.a, y, s != nullptr ? &chunk : nullptr, progress);
    if (s != nullptr) s->chunks.push_back(std::move(chunk));
    weight_ring_advance(ring, j);
  }
  if (s != nullptr) s->norm = std::move(norm);
  return y;
}

Tensor TspStep::mlp_backward(int l, const ShardedWeights& w, const RingMlpSaved& s, const Tensor& d_out,
                             ShardedWeights& grads) {
  Tensor d_a2 = act({rows_, dims_.h});  // [T, h], summed over the D chunks
  be_.fill(0.0, d_a2);
  WeightRing ring = weight_ring(w.mlp[l]);
  // The gradient ring runs behind the products it carries: now, or in W (after_products).
  auto gring = std::make_shared<GradRing>(grad_ring(*ring.axis));
  for (int j = 0; j < D_; ++j) {
    weight_ring_send(ring, j);
    Tensor partial = grad_ring_partial(grads.mlp[l], j, {dims_.mlp_rows(), dims_.h});
    MlpWeights g = mlp_chunk(partial);
    // The bias gradients of this chunk into a zeroed scratch (the weights' beta below is the
    // ring's), then into the partials of the owner's columns (and the down bias at step 0).
    const bool biased = static_cast<size_t>(l) < variant_partials_.mlp_bias.size();
    if (biased) {
      be_.fill(0.0, unit_mlp_bias_grad_);
      g.b_gate = unit_mlp_bias_grad_.narrow(0, dims_.f_rows);
      g.b_up = unit_mlp_bias_grad_.narrow(dims_.f_rows, 2 * dims_.f_rows);
      if (j == 0) g.down.b = unit_mlp_bias_grad_.narrow(2 * dims_.f_rows, 2 * dims_.f_rows + dims_.h);
    }
    foldpar::mlp_backward(ctx_, mlp_chunk(ring.cur, w, l, j), s.chunks[j], s.norm.a, d_out, d_a2, g,
                          j == 0 ? 1.0f : 0.0f);
    if (biased) {
      MlpWeights into;
      attach_mlp_bias(variant_partials_, l, ring_owner(j) * dims_.f_rows, dims_.f_rows, into);
      be_.add_inplace(g.b_gate, into.b_gate);
      be_.add_inplace(g.b_up, into.b_up);
      if (j == 0) be_.add_inplace(g.down.b, variant_partials_.down_bias[static_cast<size_t>(l)]);
    }
    after_products([this, gring, j, partial]() mutable { grad_ring_send(*gring, j, partial); });
    weight_ring_advance(ring, j);
  }
  after_products([this, gring, own = grads.mlp[l]]() mutable { grad_ring_finish(*gring, own); });
  // The norm gain's partial stays local until sum_norm_partials().
  return norm_backward(ctx_, w.mlp_norm[l], s.norm, d_a2, &d_out, norm_partials_[c_.num_hidden_layers + l]);
}

}  // namespace foldpar::tsp_detail
