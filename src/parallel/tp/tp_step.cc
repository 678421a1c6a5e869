// TpStep: construction, plain TP's attention core and the packed all-reduce of the norm
// gains' partial gradients (sequence parallelism).
//   attention  fwd: q, k, v of the local heads for every token (column-parallel, after f or
//              f'), RoPE, causal attention over all S positions, then the row-parallel
//              output projection and g; bwd: the adjoint, the attention's own part local.
#include "parallel/tp/tp_step.h"

#include <cmath>
#include <numeric>

#include "backend/rope_table.h"

namespace foldpar::tp_detail {

TpStep::TpStep(const TpModel& model, Backend& backend, Communicator& tp, const Batch& local)
    : TpStepBase(model.config(), model.dims(), backend, tp, model.rank(), model.options().overlap,
                 model.options().sequence_parallel, TpRows{local.batch(), model.seq(), model.local_seq()}, local) {
  if (seq_par_)
    for (int64_t i = 0; i < 2 * c_.num_hidden_layers + 1; ++i)
      norm_partials_.push_back(Tensor::zeros({dims_.h}, DType::kF32, MemCategory::kGradients));
  positions_ = Tensor::empty({tp_seq_}, DType::kI32, MemCategory::kActivations);
  std::iota(positions_.data<int32_t>(), positions_.data<int32_t>() + tp_seq_, 0);
  rope_ = build_rope_table({positions_.data<int32_t>(), static_cast<size_t>(tp_seq_)}, dims_.d, c_.rope_theta,
                           DType::kF32);
}

Tensor TpStep::attention_forward(int l, const ShardedWeights& w, const Tensor& x, AttnSaved* s, bool keep_gathered) {
  const int64_t h = dims_.h, d = dims_.d, B = batch_, S = tp_seq_, N = all_rows_, R = rows_;
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
  Tensor y = output_projection(attn, a.wo_t, x);
  if (s != nullptr) {
    *s = AttnSaved{x, rstd, a1, keep_gathered && seq_par_ ? a1_full : Tensor(), q, k, v, attn, lse, {}, {}};
  }
  return y;
}

Tensor TpStep::attention_backward(int l, const ShardedWeights& w, AttnSaved& s, const Tensor& d_out,
                                  ShardedWeights& grads) {
  const int64_t d = dims_.d, B = batch_, S = tp_seq_;
  const int64_t hl = dims_.heads, kvl = dims_.kv_heads;
  Tensor a1_full;
  TpComm::Pending a1_req;
  Tensor d_attn = output_projection_backward(l, w, s, d_out, grads, &a1_full, &a1_req, [] {});
  Tensor dq = act({B, S, hl, d}), dk = act({B, S, kvl, d}), dv = act({B, S, kvl, d});
  const AttentionArgs args{&s.q, &s.k, &s.v, &positions_, &positions_, 1.0 / std::sqrt(static_cast<double>(d))};
  be_.attention_backward(args, s.attn, s.lse, d_attn, dq, dk, dv);
  d_attn = Tensor();
  tp_.progress(a1_req);
  be_.rope_backward(rope_, dq);
  be_.rope_backward(rope_, dk);
  return qkv_backward(l, w, s, dq, dk, dv, a1_full, a1_req, d_out, grads);
}

Tensor& TpStep::norm_grad(Tensor& grad, int index) { return seq_par_ ? norm_partials_[index] : grad; }

void TpStep::sum_norm_partials(ShardedWeights& grads) {
  if (!seq_par_) return;
  // One all_reduce of every gain's partial, packed: [(2L+1) * h].
  const int64_t L = c_.num_hidden_layers, n = static_cast<int64_t>(norm_partials_.size());
  Tensor packed = comm_buffer({n, dims_.h});
  for (int64_t i = 0; i < n; ++i) {
    Tensor row = packed.narrow(i, i + 1);
    be_.copy(norm_partials_[i], row);
  }
  tp_.all_reduce(packed);
  for (int64_t i = 0; i < n; ++i) {
    Tensor& dst = i < L ? grads.attn_norm[i] : (i < 2 * L ? grads.mlp_norm[i - L] : grads.final_norm);
    be_.add_inplace(packed.narrow(i, i + 1), dst);
  }
}

}  // namespace foldpar::tp_detail
