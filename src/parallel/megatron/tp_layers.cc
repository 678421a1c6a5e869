// The tensor-parallel parts of Megatron's blocks (parallel/megatron/tp_step_base.h): the
// MLP sub-block, the attention's row-parallel output projection, and the backward of its
// column-parallel q/k/v projections and norm.
//   forward:  a = norm(x) [R, h];  a_full = f(a) [N, h];  partial = column/row GEMMs [N, h];
//             y = x + g(partial)                           f, g: parallel/tensor_parallel.h
//   backward: dy_full = g^T(dy) (identity, or all_gather); the row-parallel GEMM's adjoint
//             is local; the column-parallel GEMMs' dX (summed locally over q/k/v or
//             gate/up) goes through f^T (all_reduce, or reduce_scatter) while the weight
//             gradients compute; the norm's backward runs on this rank's rows.
// With sequence parallelism the weight gradients need every row's norm output: gathered
// again during the attention / SwiGLU backward (Megatron's choice: activations stay 1/tp),
// unless a recompute rerun kept it.
#include "parallel/megatron/tp_step_base.h"

namespace foldpar::megatron_detail {

Tensor TpStepBase::output_projection(const Tensor& attn, const Tensor& wo_t, const Tensor& x) {
  const int64_t N = all_rows_, h = dims_.h;
  // Row-parallel: this rank's part of attn Wo^T, summed over tp.
  Tensor partial = seq_par_ ? comm_buffer({N, h}) : act({N, h});
  be_.matmul(attn.reshape({N, dims_.heads * dims_.d}), false, wo_t, false, partial);
  Tensor y = reduce_rows(partial);  // fwd: g (all_reduce) or g' (reduce_scatter)
  be_.add_inplace(x, y);
  return y;
}

Tensor TpStepBase::qkv_backward(int l, const ShardedWeights& w, const AttnSaved& s, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv, const Tensor& a1_full, TpComm::Pending& a1_req,
                                const Tensor& d_out, ShardedWeights& grads) {
  const int64_t h = dims_.h, d = dims_.d, N = all_rows_, R = rows_;
  const int64_t hl = dims_.heads, kvl = dims_.kv_heads;
  const AttnPieces a = attn_pieces(dims_, w.attn[l]);
  AttnPieces g = attn_pieces(dims_, grads.attn[l]);
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
  // a1 = norm(x_in) on this rank's rows; dx = d_out + norm^T(d_a1).
  Tensor dx = act({R, h});
  be_.rmsnorm_backward(s.x_in, w.attn_norm[l], s.rstd, d_a1, dx, norm_grad(grads.attn_norm[l], l));
  be_.add_inplace(d_out, dx);
  return dx;
}

Tensor TpStepBase::mlp_forward(int l, const ShardedWeights& w, const Tensor& x_mid, MlpSaved* s, bool keep_gathered) {
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
  if (s != nullptr) *s = MlpSaved{x_mid, rstd, a2, keep_gathered && seq_par_ ? a2_full : Tensor(), gate, up, a};
  return y;
}

Tensor TpStepBase::mlp_backward(int l, const ShardedWeights& w, const MlpSaved& s, const Tensor& d_out,
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
  be_.rmsnorm_backward(s.x_mid, w.mlp_norm[l], s.rstd, d_a2, dx,
                       norm_grad(grads.mlp_norm[l], static_cast<int>(c_.num_hidden_layers) + l));
  be_.add_inplace(d_out, dx);
  return dx;
}

}  // namespace foldpar::megatron_detail
