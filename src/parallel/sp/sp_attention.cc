// SP attention: the local projections of every head, and one of the two K/V exchanges.
//   kAllGather  fwd: K, V = all_gather(k, v) over sp in rank order (2B collectives);
//               attention of the local queries against all keys (k_pos in rank order).
//               bwd: all_gather again (unless the recompute just gathered them), attention
//               backward, reduce_scatter of dK, dV (the adjoint) so each rank gets its rows.
//   kRing       parallel/ring_attention.h, forward and its adjoint.
// RoPE runs at global positions; dX stays local in both.
#include <cmath>

#include "parallel/kv_exchange.h"
#include "parallel/sp/sp_step.h"

namespace foldpar::sp_detail {

std::vector<CommRequest> SpStep::start_gather(const Tensor& k, const Tensor& v, Tensor& k_full, Tensor& v_full) {
  const Shape full{batch_, seq_, c_.num_key_value_heads, c_.head_dim()};
  k_full = comm_buffer(full);
  v_full = comm_buffer(full);
  std::vector<CommRequest> requests = start_gather_kv(comm_, k, k_full);
  for (CommRequest& r : start_gather_kv(comm_, v, v_full)) requests.push_back(std::move(r));
  if (!opt_.overlap) wait_all(requests);
  return requests;
}

RingAttentionArgs SpStep::ring_args(const LayerSaved& s) {
  RingAttentionArgs a;
  a.axis = &comm_;
  a.backend = &be_;
  a.q = &s.q;
  a.k = &s.k;
  a.v = &s.v;
  a.q_pos = &q_pos_;
  a.k_pos = &k_pos_;
  a.scale = 1.0 / std::sqrt(static_cast<double>(c_.head_dim()));
  a.overlap = opt_.overlap;
  a.wait_seconds = &wait_seconds_;
  return a;
}

Tensor SpStep::attention_forward(const LayerWeights& w, const Tensor& x, LayerSaved& s, bool keep_gathered) {
  const int64_t T = rows_, h = c_.hidden_size, n_h = c_.num_attention_heads, n_kv = c_.num_key_value_heads,
                d = c_.head_dim(), B = batch_, Sl = local_seq_;
  const bool gather = opt_.kv_exchange == LayoutOptions::KvExchange::kAllGather;
  s.rstd_attn = act({T});
  s.a1 = act({T, h});
  be_.rmsnorm_forward(x, w.attn_norm, c_.rms_norm_eps, s.a1, s.rstd_attn);
  // k and v first, so that their exchange overlaps the q projection.
  s.k = act({B, Sl, n_kv, d});
  s.v = act({B, Sl, n_kv, d});
  s.q = act({B, Sl, n_h, d});
  Tensor k2 = s.k.reshape({T, n_kv * d}), v2 = s.v.reshape({T, n_kv * d}), q2 = s.q.reshape({T, n_h * d});
  be_.matmul(s.a1, false, w.wk, true, k2);
  be_.matmul(s.a1, false, w.wv, true, v2);
  be_.rope_forward(rope_, s.k);
  Tensor k_full, v_full;
  std::vector<CommRequest> requests;
  if (gather) requests = start_gather(s.k, s.v, k_full, v_full);
  be_.matmul(s.a1, false, w.wq, true, q2);
  be_.rope_forward(rope_, s.q);
  s.attn = act({B, Sl, n_h, d});
  s.lse = act({B, n_h, Sl});
  if (gather) {
    wait_all(requests);
    const AttentionArgs args{&s.q, &k_full, &v_full, &q_pos_, &k_pos_, 1.0 / std::sqrt(static_cast<double>(d))};
    be_.attention_forward(args, s.attn, s.lse);
    if (keep_gathered) {
      s.k_full = k_full;
      s.v_full = v_full;
    }
  } else {
    ring_attention_forward(ring_args(s), s.attn, s.lse);
  }
  // x_mid = x + attn Wo^T
  Tensor x_mid = act({T, h});
  be_.copy(x, x_mid);
  be_.matmul(s.attn.reshape({T, n_h * d}), false, w.wo, true, x_mid, 1.0f, 1.0f);
  return x_mid;
}

Tensor SpStep::attention_backward(const LayerWeights& w, LayerSaved& s, const Tensor& d_out, LayerWeights& g) {
  const int64_t T = rows_, h = c_.hidden_size, n_h = c_.num_attention_heads, n_kv = c_.num_key_value_heads,
                d = c_.head_dim(), B = batch_, Sl = local_seq_;
  const bool gather = opt_.kv_exchange == LayoutOptions::KvExchange::kAllGather;
  // The gathered K/V again (a per-layer transient), arriving during the o_proj backward.
  Tensor k_full = s.k_full, v_full = s.v_full;
  s.k_full = Tensor();
  s.v_full = Tensor();
  std::vector<CommRequest> requests;
  if (gather && !k_full.defined()) requests = start_gather(s.k, s.v, k_full, v_full);
  // x_mid = x + attn Wo^T
  Tensor d_attn = act({B, Sl, n_h, d});
  Tensor d_attn2 = d_attn.reshape({T, n_h * d});
  be_.matmul(d_out, false, w.wo, false, d_attn2);
  be_.matmul(d_out, true, s.attn.reshape({T, n_h * d}), false, g.wo, 1.0f, 1.0f);
  poke(requests);

  Tensor dq = act({B, Sl, n_h, d}), dk = act({B, Sl, n_kv, d}), dv = act({B, Sl, n_kv, d});
  Tensor d_a1 = act({T, h});
  auto query_side = [&] {  // q = rope(a1 Wq^T)
    be_.rope_backward(rope_, dq);
    const Tensor dq2 = dq.reshape({T, n_h * d});
    be_.matmul(dq2, false, w.wq, false, d_a1);
    be_.matmul(dq2, true, s.a1, false, g.wq, 1.0f, 1.0f);
  };
  if (gather) {
    wait_all(requests);
    Tensor dk_full = comm_buffer(k_full.shape()), dv_full = comm_buffer(v_full.shape());
    const AttentionArgs args{&s.q, &k_full, &v_full, &q_pos_, &k_pos_, 1.0 / std::sqrt(static_cast<double>(d))};
    be_.attention_backward(args, s.attn, s.lse, d_attn, dq, dk_full, dv_full);
    k_full = Tensor();
    v_full = Tensor();
    // fwd: all_gather; bwd: reduce_scatter: each rank receives the sum for its own rows,
    // while the query side computes.
    std::vector<CommRequest> rs = start_reduce_scatter_kv(comm_, dk_full, dk);
    for (CommRequest& r : start_reduce_scatter_kv(comm_, dv_full, dv)) rs.push_back(std::move(r));
    if (!opt_.overlap) wait_all(rs);
    query_side();
    poke(rs);
    wait_all(rs);
  } else {
    ring_attention_backward(ring_args(s), s.attn, s.lse, d_attn, dq, dk, dv);
    query_side();
  }
  d_attn = Tensor();
  // k = rope(a1 Wk^T), v = a1 Wv^T
  be_.rope_backward(rope_, dk);
  const Tensor dk2 = dk.reshape({T, n_kv * d}), dv2 = dv.reshape({T, n_kv * d});
  be_.matmul(dk2, false, w.wk, false, d_a1, 1.0f, 1.0f);
  be_.matmul(dv2, false, w.wv, false, d_a1, 1.0f, 1.0f);
  be_.matmul(dk2, true, s.a1, false, g.wk, 1.0f, 1.0f);
  be_.matmul(dv2, true, s.a1, false, g.wv, 1.0f, 1.0f);
  // a1 = norm(x); dx = d_out + norm^T(d_a1)
  Tensor dx = act({T, h});
  be_.rmsnorm_backward(s.x_in, w.attn_norm, s.rstd_attn, d_a1, dx, g.attn_norm);
  be_.add_inplace(d_out, dx);
  return dx;
}

}  // namespace foldpar::sp_detail
