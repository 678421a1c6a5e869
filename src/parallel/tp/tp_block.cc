// Tensor-parallel attention and MLP (Megatron): column-parallel Q/K/V and gate/up by this
// rank's heads and columns, row-parallel output and down projections, and their adjoints.
//   forward:  a = norm(x) [R, h];  a_full = f(a) [N, h];  partial = column/row GEMMs [N, h];
//             y = x + g(partial)                           f, g: parallel/tensor_parallel.h
//   backward: dy_full = g^T(dy) (identity, or all_gather); the row-parallel GEMM's adjoint
//             is local; the column-parallel GEMMs' dX (summed locally over q/k/v or
//             gate/up) goes through f^T (all_reduce, or reduce_scatter) while the weight
//             gradients compute; the norm's backward runs on this rank's rows.
// With sequence parallelism the weight gradients need every token's norm output: gathered
// again during the attention / SwiGLU backward (Megatron's choice: activations stay 1/T),
// unless a recompute rerun kept it.
#include <cmath>

#include "parallel/tp/tp_step.h"

namespace foldpar::tp_detail {

Tensor TpStep::attention_forward(int l, const ShardedWeights& w, const Tensor& x, AttnSaved* s, bool keep_gathered) {
  const int64_t h = dims_.h, d = dims_.d, B = batch_, S = seq_, N = all_rows_, R = rows_;
  const int64_t hl = dims_.heads, kvl = dims_.kv_heads;
  const AttnPieces a = attn_pieces(dims_, w.attn[l]);
  Tensor rstd = act({R}), a1 = act({R, h});
  be_.rmsnorm_forward(x, w.attn_norm[l], c_.rms_norm_eps, a1, rstd);
  const Tensor a1_full = gather_rows(a1);  // fwd: f (identity) or f' (all_gather)
  // Column-parallel: q, k, v of this rank's heads for every token.
  Tensor q = act({B, S, hl, d}), k = act({B, S, kvl, d}), v = act({B, S, kvl, d});
  Tensor q2 = q.reshape({N, hl * d}), k2 = k.reshape({N, kvl * d}), v2 = v.reshape({N, kvl * d});
  be_.matmul(a1_full, false, a.wq, true, q2);
  be_.matmul(a1_full, false, a.wk, true, k2);
  be_.matmul(a1_full, false, a.wv, true, v2);
  be_.rope_forward(rope_, q);
  be_.rope_forward(rope_, k);
  if (kv_cache_ != nullptr) kv_cache_->store_prefill(l, 0, k, v);
  Tensor attn = act({B, S, hl, d}), lse = act({B, hl, S});
  const AttentionArgs args{&q, &k, &v, &positions_, &positions_, 1.0 / std::sqrt(static_cast<double>(d))};
  be_.attention_forward(args, attn, lse);
  // Row-parallel: this rank's part of attn Wo^T, summed over tp.
  Tensor partial = sp_ ? comm_buffer({N, h}) : act({N, h});
  be_.matmul(attn.reshape({N, hl * d}), false, a.wo_t, false, partial);
  Tensor y = reduce_rows(partial);  // fwd: g (all_reduce) or g' (reduce_scatter)
  be_.add_inplace(x, y);
  if (s != nullptr) {
    *s = AttnSaved{x, rstd, a1, keep_gathered && sp_ ? a1_full : Tensor(), q, k, v, attn, lse};
  }
  return y;
}

Tensor TpStep::attention_backward(int l, const ShardedWeights& w, const AttnSaved& s, const Tensor& d_out,
                                  ShardedWeights& grads) {
  const int64_t h = dims_.h, d = dims_.d, B = batch_, S = seq_, N = all_rows_, R = rows_;
  const int64_t hl = dims_.heads, kvl = dims_.kv_heads;
  const AttnPieces a = attn_pieces(dims_, w.attn[l]);
  AttnPieces g = attn_pieces(dims_, grads.attn[l]);
  const Tensor dy = gather_rows(d_out);  // bwd of g: identity; of g': all_gather
  // Every token's a1 for the weight gradients: at hand, kept by a rerun, or gathered again.
  Tensor a1_full = sp_ ? s.a1_full : s.a1;
  TpComm::Pending a1_req;
  if (!a1_full.defined()) {
    a1_full = comm_buffer({N, h});
    a1_req = start_gather_rows(s.a1, a1_full);
  }
  // y = attn Wo_t (row-parallel): d_attn = dy Wo_t^T, dWo_t += attn^T dy. No communication.
  Tensor d_attn = act({B, S, hl, d});
  Tensor d_attn2 = d_attn.reshape({N, hl * d});
  be_.matmul(dy, false, a.wo_t, true, d_attn2);
  tp_.progress(a1_req);
  be_.matmul(s.attn.reshape({N, hl * d}), true, dy, false, g.wo_t, 1.0f, 1.0f);
  Tensor dq = act({B, S, hl, d}), dk = act({B, S, kvl, d}), dv = act({B, S, kvl, d});
  const AttentionArgs args{&s.q, &s.k, &s.v, &positions_, &positions_, 1.0 / std::sqrt(static_cast<double>(d))};
  be_.attention_backward(args, s.attn, s.lse, d_attn, dq, dk, dv);
  d_attn = Tensor();
  tp_.progress(a1_req);
  be_.rope_backward(rope_, dq);
  be_.rope_backward(rope_, dk);
  // Column-parallel q, k, v = a1 W^T: this rank's part of d_a1, summed over tp (f^T).
  const Tensor dq2 = dq.reshape({N, hl * d}), dk2 = dk.reshape({N, kvl * d}), dv2 = dv.reshape({N, kvl * d});
  Tensor d_a1_partial = sp_ ? comm_buffer({N, h}) : act({N, h});
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
  // a1 = norm(x_in) on this rank's rows; dx = d_out + norm^T(d_a1).
  Tensor dx = act({R, h});
  be_.rmsnorm_backward(s.x_in, w.attn_norm[l], s.rstd, d_a1, dx, norm_grad(grads.attn_norm[l], l));
  be_.add_inplace(d_out, dx);
  return dx;
}

Tensor TpStep::mlp_forward(int l, const ShardedWeights& w, const Tensor& x_mid, MlpSaved* s, bool keep_gathered) {
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
  Tensor partial = sp_ ? comm_buffer({N, h}) : act({N, h});
  be_.matmul(a, false, m.w_down_t, false, partial);
  Tensor y = reduce_rows(partial);  // fwd: g or g'
  be_.add_inplace(x_mid, y);
  if (s != nullptr) *s = MlpSaved{x_mid, rstd, a2, keep_gathered && sp_ ? a2_full : Tensor(), gate, up, a};
  return y;
}

Tensor TpStep::mlp_backward(int l, const ShardedWeights& w, const MlpSaved& s, const Tensor& d_out,
                            ShardedWeights& grads) {
  const int64_t h = dims_.h, N = all_rows_, R = rows_, fr = dims_.f_rows;
  const MlpPieces m = mlp_pieces(dims_, w.mlp[l]);
  MlpPieces g = mlp_pieces(dims_, grads.mlp[l]);
  const Tensor dy = gather_rows(d_out);  // bwd of g: identity; of g': all_gather
  Tensor a2_full = sp_ ? s.a2_full : s.a2;
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
  Tensor d_a2_partial = sp_ ? comm_buffer({N, h}) : act({N, h});
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
  be_.rmsnorm_backward(s.x_mid, w.mlp_norm[l], s.rstd, d_a2, dx,
                       norm_grad(grads.mlp_norm[l], static_cast<int>(c_.num_hidden_layers) + l));
  be_.add_inplace(d_out, dx);
  return dx;
}

}  // namespace foldpar::tp_detail
