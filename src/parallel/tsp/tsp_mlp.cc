// TSP gated MLP (spec 4.2 and 5): the ring schedule and its adjoint.
//   forward, step j = 0..D-1, holding the shard of rank (p - j) mod D:
//     start hop (send cur to p+1, receive the next from p-1)   fwd: weight ring
//     y_p += (silu(a2 Wgate^T) * (a2 Wup^T)) Wdown^T            (local accumulation)
//   backward: the same weight ring again, plus the gradient ring (bwd of the weight ring)
//   that carries each shard's summed gradient home.
#include "parallel/tsp/tsp_step.h"

namespace foldpar::tsp_detail {

Tensor TspStep::mlp_forward(int l, const ShardedWeights& w, const Tensor& x_mid, MlpSaved* s) {
  const int64_t h = dims_.h, T = rows_, fr = dims_.f_rows;
  Tensor rstd = stat({T}), a2 = act({T, h});
  be_.rmsnorm_forward(x_mid, w.mlp_norm[l], c_.rms_norm_eps, a2, rstd);
  Tensor y = act({T, h});
  be_.copy(x_mid, y);
  if (s != nullptr) *s = MlpSaved{x_mid, rstd, a2, {}, {}, {}};
  WeightRing ring = weight_ring(w.mlp[l]);
  std::vector<CommRequest> none;
  for (int j = 0; j < D_; ++j) {
    weight_ring_send(ring, j);
    const MlpPieces m = mlp_pieces(dims_, ring.cur);
    Tensor gate = act({T, fr}), up = act({T, fr}), a = act({T, fr});
    be_.matmul(a2, false, m.w_gate, true, gate);
    if (ring.hop.pending()) {
      bool done = false;
      FP_CHECK_OK(ring.hop.test(&done));
    }
    be_.matmul(a2, false, m.w_up, true, up);
    be_.swiglu_forward(gate, up, a);
    be_.matmul(a, false, m.w_down_t, false, y, 1.0f, 1.0f);
    if (s != nullptr) {
      s->gate.push_back(gate);
      s->up.push_back(up);
      s->act.push_back(a);
    }
    weight_ring_advance(ring, j);
  }
  return y;
}

Tensor TspStep::mlp_backward(int l, const ShardedWeights& w, const MlpSaved& s, const Tensor& d_out, ShardedWeights& grads) {
  const int64_t h = dims_.h, T = rows_, fr = dims_.f_rows;
  Tensor d_a2 = act({T, h});
  be_.fill(0.0, d_a2);
  WeightRing ring = weight_ring(w.mlp[l]);
  GradRing gring;
  for (int j = 0; j < D_; ++j) {
    weight_ring_send(ring, j);
    const MlpPieces m = mlp_pieces(dims_, ring.cur);
    Tensor partial = grad_ring_partial(grads.mlp[l], j, {dims_.mlp_rows(), h});
    MlpPieces g = mlp_pieces(dims_, partial);
    const float beta = j == 0 ? 1.0f : 0.0f;
    // y += act Wdown^T: d_act = dy Wdown, dWdown^T += act^T dy
    Tensor d_act = act({T, fr});
    be_.matmul(d_out, false, m.w_down_t, true, d_act);
    be_.matmul(s.act[j], true, d_out, false, g.w_down_t, 1.0f, beta);
    Tensor d_gate = act({T, fr}), d_up = act({T, fr});
    be_.swiglu_backward(s.gate[j], s.up[j], d_act, d_gate, d_up);
    d_act = Tensor();
    // gate = a2 Wgate^T, up = a2 Wup^T
    be_.matmul(d_gate, false, m.w_gate, false, d_a2, 1.0f, 1.0f);
    be_.matmul(d_up, false, m.w_up, false, d_a2, 1.0f, 1.0f);
    be_.matmul(d_gate, true, s.a2, false, g.w_gate, 1.0f, beta);
    be_.matmul(d_up, true, s.a2, false, g.w_up, 1.0f, beta);
    grad_ring_send(gring, j, partial);
    weight_ring_advance(ring, j);
  }
  grad_ring_finish(gring, grads.mlp[l]);
  Tensor dx = act({T, h});
  be_.rmsnorm_backward(s.x_mid, w.mlp_norm[l], s.rstd, d_a2, dx, norm_partials_[c_.num_hidden_layers + l]);
  be_.add_inplace(d_out, dx);
  return dx;
}

}  // namespace foldpar::tsp_detail
