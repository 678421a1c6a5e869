// Megatron attention: the model's q/k/v and output projection (model/sub_blocks.h) on this
// rank's heads, column- and row-parallel over tp (tp_layers.cc, which also holds the MLP), on
// the sp shard's rows; attention sees every
// sp rank's keys of this rank's KV heads:
//   one sp rank  every position's keys are local: attention forward and backward, no exchange.
//   kAllGather   fwd: all_gather(k, v) over sp in rank order (2B collectives), attention of the
//                local queries against all keys; bwd: all_gather again (unless a rerun kept
//                them), attention backward, reduce_scatter(dK, dV) over sp.
//   kRing        parallel/ring_attention.h over sp, forward and its adjoint.
//   tp:          fwd: a_full = f(norm(x)); y = x + g(partial);  bwd: dy_full = g^T(dy); the
//                column-parallel GEMMs' dX through f^T while the weight gradients compute.
// With sequence parallelism the weight gradients need every row's norm output: gathered
// again during the o_proj / SwiGLU backward (Megatron's choice), unless a rerun kept it.
#include <cmath>

#include "parallel/kv_exchange.h"
#include "parallel/megatron/megatron_step.h"

namespace foldpar::megatron_detail {

double MegatronStep::attention_scale() const { return 1.0 / std::sqrt(static_cast<double>(dims_.d)); }

std::vector<CommRequest> MegatronStep::start_gather_kv_pair(const Tensor& k, const Tensor& v, Tensor& k_full,
                                                            Tensor& v_full) {
  const Shape full{batch_, model_.shard().seq(), dims_.kv_heads, dims_.d};
  k_full = comm_buffer(full);
  v_full = comm_buffer(full);
  std::vector<CommRequest> requests = start_gather_kv(sp_, k, k_full);
  for (CommRequest& r : start_gather_kv(sp_, v, v_full)) requests.push_back(std::move(r));
  if (!opt_.overlap) tp_.timer().wait_all(requests);
  return requests;
}

RingAttentionArgs MegatronStep::ring_args(const AttnSaved& s) {
  RingAttentionArgs a;
  a.axis = &sp_;
  a.backend = &be_;
  a.q = &s.qkv.q;
  a.k = &s.qkv.k;
  a.v = &s.qkv.v;
  a.q_pos = &q_pos_;
  a.k_pos = &k_pos_;
  a.q_positions = q_positions_;
  a.k_positions = local_ ? q_positions_ : k_positions_;
  a.scale = attention_scale();
  a.window = ctx_.config->sliding_window;
  a.overlap = opt_.overlap;
  a.timer = &tp_.timer();
  return a;
}

Tensor MegatronStep::attention_forward(int l, const Tensor& x, AttnSaved* saved, bool keep_gathered) {
  const int64_t d = dims_.d, B = batch_, Sl = tp_seq_;
  const int64_t hl = dims_.heads;
  AttnSaved local;
  AttnSaved& s = saved != nullptr ? *saved : local;
  s.norm = norm_forward(row_ctx_, w_.attn_norm[l], x);  // a1 [R, h]
  const Tensor a1_full = gather_rows(s.norm.a);          // fwd: f (identity) or f' (all_gather over tp)
  // The model's q/k/v of this rank's heads (column-parallel); k and v come first, so that
  // their exchange over sp overlaps the q projection.
  Tensor k_full, v_full;
  std::vector<CommRequest> requests;
  s.qkv = qkv_forward(ctx_, qkv_view(w_, l), a1_full, [&](const Tensor& k, const Tensor& v) {
    if (kv_cache_ != nullptr) kv_cache_->store_prefill(be_, l, 0, k, v);
    if (gather_) requests = start_gather_kv_pair(k, v, k_full, v_full);  // fwd: all_gather over sp
  });
  s.attn = act({B, Sl, hl, d});
  s.lse = stat({B, hl, Sl});  // f32 whatever the storage
  if (local_) {
    const AttentionArgs args{&s.qkv.q, &s.qkv.k, &s.qkv.v, &q_pos_, &k_pos_, attention_scale(), ctx_.config->sliding_window};
    be_.attention_forward(args, s.attn, s.lse);
  } else if (gather_) {
    tp_.timer().wait_all(requests);
    const AttentionArgs args{&s.qkv.q, &k_full, &v_full, &q_pos_, &k_pos_, attention_scale(), ctx_.config->sliding_window};
    be_.attention_forward(args, s.attn, s.lse);
    if (keep_gathered) {
      s.k_full = k_full;
      s.v_full = v_full;
    }
  } else {
    ring_attention_forward(ring_args(s), s.attn, s.lse);  // fwd: K/V ring over sp
  }
  if (keep_gathered && seq_par_) s.a1_full = a1_full;
  return output_projection(l, s.attn, x);
}

Tensor MegatronStep::attention_backward(int l, AttnSaved& s, const Tensor& d_out) {
  const int64_t d = dims_.d, B = batch_, Sl = tp_seq_;
  const int64_t hl = dims_.heads, kvl = dims_.kv_heads;
  StepTimer& timer = tp_.timer();
  // The gathered K/V again (a per-layer transient), arriving during the o_proj backward.
  Tensor k_full = s.k_full, v_full = s.v_full;
  s.k_full = Tensor();
  s.v_full = Tensor();
  std::vector<CommRequest> kv_req;
  if (gather_ && !k_full.defined()) kv_req = start_gather_kv_pair(s.qkv.k, s.qkv.v, k_full, v_full);
  Tensor a1_full;
  TpComm::Pending a1_req;
  Tensor d_attn = output_projection_backward(l, s, d_out, &a1_full, &a1_req, [&kv_req] { StepTimer::poke(kv_req); });
  Tensor dq = act({B, Sl, hl, d}), dk = act({B, Sl, kvl, d}), dv = act({B, Sl, kvl, d});
  if (local_) {
    const AttentionArgs args{&s.qkv.q, &s.qkv.k, &s.qkv.v, &q_pos_, &k_pos_, attention_scale(), ctx_.config->sliding_window};
    be_.attention_backward(args, s.attn, s.lse, d_attn, dq, dk, dv);
    tp_.progress(a1_req);
  } else if (gather_) {
    timer.wait_all(kv_req);
    Tensor dk_full = comm_buffer(k_full.shape()), dv_full = comm_buffer(v_full.shape());
    const AttentionArgs args{&s.qkv.q, &k_full, &v_full, &q_pos_, &k_pos_, attention_scale(), ctx_.config->sliding_window};
    be_.attention_backward(args, s.attn, s.lse, d_attn, dq, dk_full, dv_full);
    k_full = Tensor();
    v_full = Tensor();
    // bwd of the all_gather: reduce_scatter over sp, each rank receiving its rows' sum.
    std::vector<CommRequest> rs = start_reduce_scatter_kv(sp_, dk_full, dk);
    for (CommRequest& r : start_reduce_scatter_kv(sp_, dv_full, dv)) rs.push_back(std::move(r));
    if (!opt_.overlap) timer.wait_all(rs);
    tp_.progress(a1_req);
    StepTimer::poke(rs);
    timer.wait_all(rs);
  } else {
    ring_attention_backward(ring_args(s), s.attn, s.lse, d_attn, dq, dk, dv);  // bwd: K/V ring + dK/dV ring
  }
  d_attn = Tensor();
  // The model's q/k/v backward (RoPE's adjoint included). The gains' gradients go where
  // norm_grad says; summed with the others' at the end of the step (sum_partials).
  return qkv_backward(l, s, QkvGrads{&dq, &dk, &dv}, a1_full, a1_req, d_out);
}

}  // namespace foldpar::megatron_detail
