// The tensor-parallel mappings around the model's sub-blocks (model/sub_blocks.h) in
// Megatron's blocks (parallel/megatron/tp_step_base.h): the MLP sub-block, the attention's
// row-parallel output projection, and the backward of its column-parallel q/k/v projections
// and norm. The math is the model's, on this rank's heads and f/tp MLP columns; here:
//   forward:  a = norm(x) [R, h];  a_full = f(a) [N, h];  partial = the sub-block [N, h]
//             (written: y_beta 0);  y = x + g(partial)    f, g: parallel/tensor_parallel.h
//   backward: dy_full = g^T(dy) (identity, or all_gather); the row-parallel GEMM's adjoint
//             is local; the column-parallel GEMMs' dX (a fresh partial the sub-block
//             allocates, summed locally over q/k/v or gate/up) goes through f^T (all_reduce,
//             or reduce_scatter) while the weight gradients compute; the norm's backward runs
//             on this rank's rows.
// With sequence parallelism the weight gradients need every row's norm output: gathered
// again during the attention / SwiGLU backward (Megatron's choice: activations stay 1/tp),
// unless a recompute rerun kept it.
// The attention variants (replicated, sharded_weights.h): this rank's heads' q/k/v bias
// slices and the q/k norm gains ride in the model's q/k/v sub-block (qkv_view); the o bias in
// tp rank 0's row-parallel partial, so g / g' adds it once. Gradients: the o bias's from dy
// (every row on every tp rank, so no tp sum), the rest into per-step partials summed over tp
// (sum_variant_grads). Llama's mlp_bias likewise: this rank's columns' gate/up bias slices
// with its MLP, their gradients into the partials; the down bias in tp rank 0's partial, its
// gradient from dy without a tp sum.
#include "model/weight_grad_queue.h"
#include "parallel/megatron/tp_step_base.h"

namespace foldpar::megatron_detail {

Tensor TpStepBase::output_projection(int l, const Tensor& attn, const Tensor& x) {
  // Row-parallel: this rank's part of attn Wo^T, summed over tp.
  Tensor partial = row_partial();
  LinearView wo = wo_view(w_.attn[l]);
  // The o bias (replicated) rides in tp rank 0's partial: the sum (g or g') adds it once to
  // every row, with no extra pass.
  if (tp_.rank() == 0 && static_cast<size_t>(l) < w_.o_bias.size()) wo.b = w_.o_bias[l];
  attn_output_forward(ctx_, wo, attn, partial, /*y_beta=*/0.0f);
  Tensor y = reduce_rows(partial);  // fwd: g (all_reduce) or g' (reduce_scatter)
  be_.add_inplace(x, y);
  return y;
}

Tensor TpStepBase::output_projection_backward(int l, AttnSaved& s, const Tensor& d_out, Tensor* a1_full,
                                              TpComm::Pending* a1_req, const std::function<void()>& between) {
  const Tensor dy = gather_rows(d_out);  // bwd of g: identity; of g': all_gather
  // Every row's a1 for the weight gradients: at hand, kept by a rerun, or gathered again.
  *a1_full = seq_par_ ? s.a1_full : s.norm.a;
  s.a1_full = Tensor();
  if (!a1_full->defined()) {
    *a1_full = comm_buffer({all_rows_, dims_.h});
    *a1_req = start_gather_rows(s.norm.a, *a1_full);
  }
  // y = attn Wo_t (row-parallel): d_attn = dy Wo_t^T, dWo_t += attn^T dy. No communication.
  LinearView g_wo = wo_view(in_.grads->attn[l]);
  // dy holds every row of the tp group on every tp rank: the o bias's gradient (its column
  // sums) is the same on each, complete over tp without a sum.
  if (static_cast<size_t>(l) < in_.grads->o_bias.size()) g_wo.b = in_.grads->o_bias[l];
  return attn_output_backward(ctx_, wo_view(w_.attn[l]), s.attn, dy, g_wo, 1.0f, [&] {
    tp_.progress(*a1_req);
    between();
  });
}

Tensor TpStepBase::qkv_backward(int l, const AttnSaved& s, const QkvGrads& d, const Tensor& a1_full,
                                TpComm::Pending& a1_req, const Tensor& d_out) {
  ShardedWeights& grads = *in_.grads;
  QkvWeights g = qkv_view(grads.attn[l]);
  attach_attn_variants(variant_partials_, l, tp_.rank() * dims_.heads, dims_.heads, dims_.kv_head0(tp_.rank()),
                       dims_.kv_heads, g);
  // KV replicas (n_kv < tp): each rank's wk/wv gradient is its own query heads' part, into a
  // scratch summed over the KV group below (sum_kv_replicas) and then added, so the replicas
  // get the same sum (under zb the scratch is held to W, 2 kv_rows h f32 per layer). dX needs
  // no change: the all_reduce of d_a1 adds every rank's dK Wk.
  Tensor kv_partial;
  if (dims_.replicated_kv()) {
    kv_partial = Tensor::empty({2 * dims_.kv_rows, dims_.h}, DType::kF32, MemCategory::kGradients);
    be_.fill(0.0, kv_partial);
    g.wk = kv_partial.narrow(0, dims_.kv_rows);
    g.wv = kv_partial.narrow(dims_.kv_rows, 2 * dims_.kv_rows);
  }
  // Column-parallel q, k, v = a1 W^T: this rank's part of d_a1, summed over tp (f^T) while
  // the weight gradients compute.
  Tensor d_a1_partial, d_a1;  // [N, h], [R, h]
  TpComm::Pending dx_req;
  BackwardSchedule sched;
  sched.d_input_category = partial_category();
  sched.input_done = [&] {
    dx_req = start_reduce_rows(d_a1_partial, d_a1);  // bwd of f: all_reduce; of f': reduce_scatter
    tp_.wait(a1_req);
  };
  sched.between = [&] { tp_.progress(dx_req); };
  foldpar::qkv_backward(ctx_, qkv_view(w_, l), a1_full, d, d_a1_partial, g, 1.0f, sched, &s.qkv);
  tp_.wait(dx_req);
  if (kv_partial.defined()) {
    // After the products that write kv_partial: at once, or in W under the zero-bubble
    // schedule (ctx_.weight_grads), where every tp rank of the stage runs it at the same slot.
    auto sum_and_add = [this, kv_partial, rows = kv_replica_rows(dims_, grads.attn[l])]() mutable {
      const auto t0 = StepTimer::Clock::now();
      tp_.timer().blocking(sum_kv_replicas(be_, tp_.comm(), dims_, kv_partial), t0);
      be_.add_inplace(kv_partial, rows);
    };
    if (ctx_.weight_grads != nullptr) ctx_.weight_grads->push_action(std::move(sum_and_add));
    else sum_and_add();
  }
  // a1 = norm(x_in) on this rank's rows; dx = d_out + norm^T(d_a1).
  return norm_backward(row_ctx_, w_.attn_norm[l], s.norm, d_a1, &d_out, norm_grad(grads.attn_norm[l], l));
}

Tensor TpStepBase::mlp_forward(int l, const Tensor& x_mid, TpMlpSaved* s, bool keep_gathered) {
  NormSaved norm = norm_forward(row_ctx_, w_.mlp_norm[l], x_mid);  // a2 [R, h]
  const Tensor a2_full = gather_rows(norm.a);                       // fwd: f or f'
  // Row-parallel down projection, summed over tp: the model's MLP on this rank's columns
  // writes the partial.
  Tensor partial = row_partial();
  MlpSaved chunk;  // gate, up, act [N, f/tp]: held to the end either way
  foldpar::mlp_forward(ctx_, mlp_biased_view(l), a2_full, partial, &chunk, {}, /*y_beta=*/0.0f);
  Tensor y = reduce_rows(partial);  // fwd: g or g'
  be_.add_inplace(x_mid, y);
  if (s != nullptr)
    *s = TpMlpSaved{std::move(norm), keep_gathered && seq_par_ ? a2_full : Tensor(), std::move(chunk), {}};
  return y;
}

Tensor TpStepBase::mlp_backward(int l, const TpMlpSaved& s, const Tensor& d_out) {
  ShardedWeights& grads = *in_.grads;
  MlpWeights g = mlp_view(grads.mlp[l]);
  attach_mlp_bias(variant_partials_, l, tp_.rank() * dims_.f_rows, dims_.f_rows, g);
  // dy holds every row of the tp group on every tp rank: the down bias's gradient is complete
  // on each, as the o bias's.
  if (static_cast<size_t>(l) < grads.down_bias.size()) g.down.b = grads.down_bias[l];
  const Tensor dy = gather_rows(d_out);  // bwd of g: identity; of g': all_gather
  Tensor a2_full = seq_par_ ? s.a2_full : s.norm.a;
  TpComm::Pending a2_req;
  if (!a2_full.defined()) {
    a2_full = comm_buffer({all_rows_, dims_.h});
    a2_req = start_gather_rows(s.norm.a, a2_full);
  }
  // Column-parallel gate, up = a2 W^T: this rank's part of d_a2, summed over tp (f^T) while
  // the weight half computes.
  Tensor d_a2_partial, d_a2;  // [N, h], [R, h]
  TpComm::Pending dx_req;
  BackwardSchedule sched;
  sched.d_input_category = partial_category();
  sched.between = [&] {
    tp_.progress(a2_req);
    tp_.progress(dx_req);
  };
  const MlpInputGrads d = mlp_backward_input(ctx_, mlp_biased_view(l), s.mlp, dy, d_a2_partial, g, 1.0f, sched);
  dx_req = start_reduce_rows(d_a2_partial, d_a2);
  tp_.wait(a2_req);
  mlp_backward_weight(ctx_, d, a2_full, g, 1.0f, sched);
  tp_.wait(dx_req);
  // a2 = norm(x_mid); dx_mid = d_out + norm^T(d_a2).
  return norm_backward(row_ctx_, w_.mlp_norm[l], s.norm, d_a2, &d_out,
                       norm_grad(grads.mlp_norm[l], static_cast<int>(c_.num_hidden_layers) + l));
}

}  // namespace foldpar::megatron_detail
