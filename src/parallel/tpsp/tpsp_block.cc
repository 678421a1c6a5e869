// TP x SP attention and MLP: TP's column-parallel Q/K/V and gate/up, row-parallel output
// and down projections over tp, on the sp shard's rows; attention sees every sp rank's keys
// of this rank's KV heads through one of two exchanges over sp:
//   kAllGather  fwd: all_gather(k, v) over sp in rank order (2B collectives), attention of the
//               local queries against all keys; bwd: all_gather again (unless a rerun kept
//               them), attention backward, reduce_scatter(dK, dV) over sp.
//   kRing       parallel/ring_attention.h over sp, forward and its adjoint.
//   tp:         fwd: a_full = f(norm(x)); y = x + g(partial);  bwd: dy_full = g^T(dy); the
//               column-parallel GEMMs' dX through f^T while the weight gradients compute.
// With sequence parallelism the weight gradients need every row's norm output: gathered
// again during the o_proj / SwiGLU backward (Megatron's choice), unless a rerun kept it.
#include <cmath>

#include "parallel/kv_exchange.h"
#include "parallel/tpsp/tpsp_step.h"

namespace foldpar::tpsp_detail {

double TpspStep::attention_scale() const { return 1.0 / std::sqrt(static_cast<double>(dims_.d)); }

std::vector<CommRequest> TpspStep::start_gather_kv_pair(const Tensor& k, const Tensor& v, Tensor& k_full,
                                                         Tensor& v_full) {
  const Shape full{batch_, model_.shard().seq(), dims_.kv_heads, dims_.d};
  k_full = comm_buffer(full);
  v_full = comm_buffer(full);
  std::vector<CommRequest> requests = start_gather_kv(sp_, k, k_full);
  for (CommRequest& r : start_gather_kv(sp_, v, v_full)) requests.push_back(std::move(r));
  if (!opt_.overlap) sp_wait(requests);
  return requests;
}

RingAttentionArgs TpspStep::ring_args(const AttnSaved& s) {
  RingAttentionArgs a;
  a.axis = &sp_;
  a.backend = &be_;
  a.q = &s.q;
  a.k = &s.k;
  a.v = &s.v;
  a.q_pos = &q_pos_;
  a.k_pos = &k_pos_;
  a.scale = attention_scale();
  a.overlap = opt_.overlap;
  a.wait_seconds = &sp_wait_seconds_;
  return a;
}

Tensor TpspStep::attention_forward(int l, const ShardedWeights& w, const Tensor& x, AttnSaved* saved,
                                   bool keep_gathered) {
  const int64_t h = dims_.h, d = dims_.d, B = batch_, Sl = sp_seq_, N = all_rows_, R = rows_;
  const int64_t hl = dims_.heads, kvl = dims_.kv_heads;
  const AttnPieces a = attn_pieces(dims_, w.attn[l]);
  AttnSaved local;
  AttnSaved& s = saved != nullptr ? *saved : local;
  s.x_in = x;
  s.rstd = act({R});
  s.a1 = act({R, h});
  be_.rmsnorm_forward(x, w.attn_norm[l], c_.rms_norm_eps, s.a1, s.rstd);
  const Tensor a1_full = gather_rows(s.a1);  // fwd: f (identity) or f' (all_gather over tp)
  // Column-parallel k and v of this rank's KV heads first, so that their exchange over sp
  // overlaps the q projection.
  s.k = act({B, Sl, kvl, d});
  s.v = act({B, Sl, kvl, d});
  s.q = act({B, Sl, hl, d});
  Tensor k2 = s.k.reshape({N, kvl * d}), v2 = s.v.reshape({N, kvl * d}), q2 = s.q.reshape({N, hl * d});
  be_.matmul(a1_full, false, a.wk, true, k2);
  be_.matmul(a1_full, false, a.wv, true, v2);
  be_.rope_forward(rope_, s.k);
  Tensor k_full, v_full;
  std::vector<CommRequest> requests;
  if (gather_) requests = start_gather_kv_pair(s.k, s.v, k_full, v_full);  // fwd: all_gather over sp
  be_.matmul(a1_full, false, a.wq, true, q2);
  be_.rope_forward(rope_, s.q);
  s.attn = act({B, Sl, hl, d});
  s.lse = act({B, hl, Sl});
  if (gather_) {
    sp_wait(requests);
    const AttentionArgs args{&s.q, &k_full, &v_full, &q_pos_, &k_pos_, attention_scale()};
    be_.attention_forward(args, s.attn, s.lse);
    if (keep_gathered) {
      s.k_full = k_full;
      s.v_full = v_full;
    }
  } else {
    ring_attention_forward(ring_args(s), s.attn, s.lse);  // fwd: K/V ring over sp
  }
  if (keep_gathered && seq_par_) s.a1_full = a1_full;
  // Row-parallel: this rank's part of attn Wo^T, summed over tp.
  Tensor partial = seq_par_ ? comm_buffer({N, h}) : act({N, h});
  be_.matmul(s.attn.reshape({N, hl * d}), false, a.wo_t, false, partial);
  Tensor y = reduce_rows(partial);  // fwd: g (all_reduce) or g' (reduce_scatter)
  be_.add_inplace(x, y);
  return y;
}

Tensor TpspStep::attention_backward(int l, const ShardedWeights& w, AttnSaved& s, const Tensor& d_out,
                                    ShardedWeights& grads) {
  const int64_t h = dims_.h, d = dims_.d, B = batch_, Sl = sp_seq_, N = all_rows_, R = rows_;
  const int64_t hl = dims_.heads, kvl = dims_.kv_heads;
  const AttnPieces a = attn_pieces(dims_, w.attn[l]);
  AttnPieces g = attn_pieces(dims_, grads.attn[l]);
  const Tensor dy = gather_rows(d_out);  // bwd of g: identity; of g': all_gather over tp
  // Every row's a1 for the weight gradients: at hand, kept by a rerun, or gathered again.
  Tensor a1_full = seq_par_ ? s.a1_full : s.a1;
  s.a1_full = Tensor();
  TpComm::Pending a1_req;
  if (!a1_full.defined()) {
    a1_full = comm_buffer({N, h});
    a1_req = start_gather_rows(s.a1, a1_full);
  }
  // The gathered K/V again (a per-layer transient), arriving during the o_proj backward.
  Tensor k_full = s.k_full, v_full = s.v_full;
  s.k_full = Tensor();
  s.v_full = Tensor();
  std::vector<CommRequest> kv_req;
  if (gather_ && !k_full.defined()) kv_req = start_gather_kv_pair(s.k, s.v, k_full, v_full);
  // y = attn Wo_t (row-parallel): d_attn = dy Wo_t^T, dWo_t += attn^T dy. No communication.
  Tensor d_attn = act({B, Sl, hl, d});
  Tensor d_attn2 = d_attn.reshape({N, hl * d});
  be_.matmul(dy, false, a.wo_t, true, d_attn2);
  tp_.progress(a1_req);
  sp_poke(kv_req);
  be_.matmul(s.attn.reshape({N, hl * d}), true, dy, false, g.wo_t, 1.0f, 1.0f);
  Tensor dq = act({B, Sl, hl, d}), dk = act({B, Sl, kvl, d}), dv = act({B, Sl, kvl, d});
  if (gather_) {
    sp_wait(kv_req);
    Tensor dk_full = comm_buffer(k_full.shape()), dv_full = comm_buffer(v_full.shape());
    const AttentionArgs args{&s.q, &k_full, &v_full, &q_pos_, &k_pos_, attention_scale()};
    be_.attention_backward(args, s.attn, s.lse, d_attn, dq, dk_full, dv_full);
    k_full = Tensor();
    v_full = Tensor();
    // bwd of the all_gather: reduce_scatter over sp, each rank receiving its rows' sum,
    // while the query side's RoPE adjoint computes.
    std::vector<CommRequest> rs = start_reduce_scatter_kv(sp_, dk_full, dk);
    for (CommRequest& r : start_reduce_scatter_kv(sp_, dv_full, dv)) rs.push_back(std::move(r));
    if (!opt_.overlap) sp_wait(rs);
    be_.rope_backward(rope_, dq);
    tp_.progress(a1_req);
    sp_poke(rs);
    sp_wait(rs);
  } else {
    ring_attention_backward(ring_args(s), s.attn, s.lse, d_attn, dq, dk, dv);  // bwd: K/V ring + dK/dV ring
    be_.rope_backward(rope_, dq);
  }
  d_attn = Tensor();
  be_.rope_backward(rope_, dk);
  // Column-parallel q, k, v = a1 W^T: this rank's part of d_a1, summed over tp (f^T).
  const Tensor dq2 = dq.reshape({N, hl * d}), dk2 = dk.reshape({N, kvl * d}), dv2 = dv.reshape({N, kvl * d});
  Tensor d_a1_partial = seq_par_ ? comm_buffer({N, h}) : act({N, h});
  be_.matmul(dq2, false, a.wq, false, d_a1_partial);
  be_.matmul(dk2, false, a.wk, false, d_a1_partial, 1.0f, 1.0f);
  be_.matmul(dv2, false, a.wv, false, d_a1_partial, 1.0f, 1.0f);
  Tensor d_a1;
  TpComm::Pending dx_req = start_reduce_rows(d_a1_partial, d_a1);  // bwd of f: all_reduce; of f': reduce_scatter
  // The weight gradients compute while dX travels.
  tp_.wait(a1_req);
  be_.matmul(dq2, true, a1_full, false, g.wq, 1.0f, 1.0f);
  tp_.progress(dx_req);
  be_.matmul(dk2, true, a1_full, false, g.wk, 1.0f, 1.0f);
  tp_.progress(dx_req);
  be_.matmul(dv2, true, a1_full, false, g.wv, 1.0f, 1.0f);
  tp_.wait(dx_req);
  // a1 = norm(x_in) on this rank's rows; dx = d_out + norm^T(d_a1). The gain's gradient is
  // this rank's partial, summed with the others' at the end of the step.
  Tensor dx = act({R, h});
  be_.rmsnorm_backward(s.x_in, w.attn_norm[l], s.rstd, d_a1, dx, grads.attn_norm[l]);
  be_.add_inplace(d_out, dx);
  return dx;
}

Tensor TpspStep::mlp_forward(int l, const ShardedWeights& w, const Tensor& x_mid, MlpSaved* saved,
                             bool keep_gathered) {
  const int64_t h = dims_.h, N = all_rows_, R = rows_, fr = dims_.f_rows;
  const MlpPieces m = mlp_pieces(dims_, w.mlp[l]);
  Tensor rstd = act({R}), a2 = act({R, h});
  be_.rmsnorm_forward(x_mid, w.mlp_norm[l], c_.rms_norm_eps, a2, rstd);
  const Tensor a2_full = gather_rows(a2);  // fwd: f or f'
  // Column-parallel gate and up of this rank's columns.
  Tensor gate = act({N, fr}), up = act({N, fr}), a = act({N, fr});
  be_.matmul(a2_full, false, m.w_gate, true, gate);
  be_.matmul(a2_full, false, m.w_up, true, up);
  be_.swiglu_forward(gate, up, a);
  // Row-parallel down projection, summed over tp.
  Tensor partial = seq_par_ ? comm_buffer({N, h}) : act({N, h});
  be_.matmul(a, false, m.w_down_t, false, partial);
  Tensor y = reduce_rows(partial);  // fwd: g or g'
  be_.add_inplace(x_mid, y);
  if (saved != nullptr)
    *saved = MlpSaved{x_mid, rstd, a2, keep_gathered && seq_par_ ? a2_full : Tensor(), gate, up, a};
  return y;
}

Tensor TpspStep::mlp_backward(int l, const ShardedWeights& w, const MlpSaved& s, const Tensor& d_out,
                              ShardedWeights& grads) {
  const int64_t h = dims_.h, N = all_rows_, R = rows_, fr = dims_.f_rows;
  const MlpPieces m = mlp_pieces(dims_, w.mlp[l]);
  MlpPieces g = mlp_pieces(dims_, grads.mlp[l]);
  const Tensor dy = gather_rows(d_out);  // bwd of g: identity; of g': all_gather
  Tensor a2_full = seq_par_ ? s.a2_full : s.a2;
  TpComm::Pending a2_req;
  if (!a2_full.defined()) {
    a2_full = comm_buffer({N, h});
    a2_req = start_gather_rows(s.a2, a2_full);
  }
  // y = act Wd_t (row-parallel): d_act = dy Wd_t^T, dWd_t += act^T dy.
  Tensor d_act = act({N, fr});
  be_.matmul(dy, false, m.w_down_t, true, d_act);
  tp_.progress(a2_req);
  be_.matmul(s.act, true, dy, false, g.w_down_t, 1.0f, 1.0f);
  Tensor d_gate = act({N, fr}), d_up = act({N, fr});
  be_.swiglu_backward(s.gate, s.up, d_act, d_gate, d_up);
  d_act = Tensor();
  // Column-parallel gate, up = a2 W^T: this rank's part of d_a2, summed over tp (f^T).
  Tensor d_a2_partial = seq_par_ ? comm_buffer({N, h}) : act({N, h});
  be_.matmul(d_gate, false, m.w_gate, false, d_a2_partial);
  be_.matmul(d_up, false, m.w_up, false, d_a2_partial, 1.0f, 1.0f);
  Tensor d_a2;
  TpComm::Pending dx_req = start_reduce_rows(d_a2_partial, d_a2);
  tp_.wait(a2_req);
  be_.matmul(d_gate, true, a2_full, false, g.w_gate, 1.0f, 1.0f);
  tp_.progress(dx_req);
  be_.matmul(d_up, true, a2_full, false, g.w_up, 1.0f, 1.0f);
  tp_.wait(dx_req);
  // a2 = norm(x_mid); dx_mid = d_out + norm^T(d_a2).
  Tensor dx = act({R, h});
  be_.rmsnorm_backward(s.x_mid, w.mlp_norm[l], s.rstd, d_a2, dx, grads.mlp_norm[l]);
  be_.add_inplace(d_out, dx);
  return dx;
}

}  // namespace foldpar::tpsp_detail
