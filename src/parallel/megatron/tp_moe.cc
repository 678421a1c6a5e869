// Expert parallelism on the Megatron baselines (docs/composition.md, "Expert parallelism on
// the Megatron baselines"): attention stays Megatron's (tp heads, sp tokens); in a sparse
// layer the E experts are spread over an expert axis made of the same tp x sp ranks (rank
// sp * tp + t; ShardDims::expert_degree = tp * sp: E/(tp sp) whole experts per rank, or, when
// tp sp > E, a 1/(tp sp / E) slice of one expert's f_e). Each rank routes rows of its own,
// distinct from every other rank's of the group, exactly as the single-rank layer does, and
// they meet their experts by TSP's scheme A (parallel/moe_dispatch.h: all-to-all of counts,
// point-to-point rows to the owners and back).
//
// Which rows are a rank's own:
//   sequence parallel  the R = B S/(sp tp) rows of its norm region, already distinct;
//   sp only (tp = 1)   its sp shard's rows;
//   plain tp (T > 1)   every tp rank holds all N = B S/sp rows of its sp shard (replicated):
//                      rank t takes the block [t n, (t+1) n) of each sequence (n = S/(sp T),
//                      sequence parallelism's split), dispatches those, and an all_gather over
//                      tp (all_gather_seq) restores the replicated output; backward, each
//                      takes its block of d(out) (replicated, so no communication), and an
//                      all_gather over tp restores the replicated d(a2) before the norm's
//                      backward. Chosen over "every tp rank routes every row and the outputs
//                      are summed" because that dispatches every row T times (T-fold the
//                      all-to-all and the expert FLOPs) and needs an all_reduce (twice the
//                      bytes of the all_gather) to sum them.
// Gradients: a routed expert's is its owner's alone, complete over the group's rows (every
// row routed to it came to it): not summed over sp (MegatronModel's sum over sp skips the
// expert regions, ShardedGrads::expert_regions). The router, the shared expert and its gate
// are replicated and saw this rank's rows only: summed over tp here (sum_over_tp), over sp
// with the rest of the gradients. The aux loss's statistics (per-expert counts and
// probability sums) are summed over the expert axis (and dp) once per step, before the loss.
#include <algorithm>
#include <chrono>
#include <numeric>

#include "parallel/megatron/tp_step_base.h"

namespace foldpar::megatron_detail {
namespace {

std::vector<double> host_f64(Backend& be, const Tensor& t) {
  std::vector<float> f(static_cast<size_t>(t.numel()));
  be.copy_to_host(t, std::as_writable_bytes(std::span<float>(f)));
  return std::vector<double>(f.begin(), f.end());
}

}  // namespace

void TpStepBase::drop_over_capacity(std::vector<int32_t>& ids, int64_t T, bool block_of_tp) {
  const MoeConfig& m = c_.moe;
  const int64_t k = m.num_experts_per_tok, B = batch_, n = T / batch_;
  const int64_t G = ep_->size(), sp = G / tp_.size(), S = tp_seq_ * sp, cap = m.expert_capacity(S);
  if (cap == 0) return;
  FP_CHECK(ctx_.positions != nullptr && G == tp_.size() * sp && static_cast<int64_t>(ids.size()) == T * k,
           "capacity drop: expert axis of {} ranks over tp={}, {} ids for {} rows", G, tp_.size(), ids.size(), T);
  std::vector<int32_t> sp_pos(static_cast<size_t>(tp_seq_));
  be_.copy_to_host(*ctx_.positions, std::as_writable_bytes(std::span<int32_t>(sp_pos)));
  // Each rank sends [T k ids | T positions]; row (b, i) of a rank is token pos of sequence b.
  const int64_t t0_row = block_of_tp ? tp_.rank() * n : 0, per = T * k + T;
  std::vector<int32_t> mine(ids);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) mine.push_back(sp_pos[static_cast<size_t>(t0_row + i)]);
  std::vector<int32_t> all;
  Tensor send = moe_comm_from_host(be_, mine, DType::kI32), recv = Tensor::empty({G * per}, DType::kI32, MemCategory::kComm);
  const auto t0 = std::chrono::steady_clock::now();
  tp_.timer().blocking(ep_->all_gather(send.raw_data(), recv.raw_data(), static_cast<size_t>(per), DType::kI32), t0);
  moe_comm_to_host(be_, recv, all);
  // A dry run moves no data (nor the other ranks' positions): under the plan's assumption,
  // every rank routing alike, this rank's rows take their share n / S of each capacity.
  if (!recv.has_storage()) {
    const int64_t share = (cap * n + S - 1) / S;
    moe_drop_over_capacity(ids, B, n, k, m.num_experts, std::max<int64_t>(share, 1));
    return;
  }
  std::vector<int32_t> global(static_cast<size_t>(B * S * k), kDroppedExpert);
  const auto at = [&](int64_t q, int64_t row) {  // rank q's row (b, i) = b n + i
    const int64_t pos = all[static_cast<size_t>(q * per + T * k + row)];
    FP_CHECK(pos >= 0 && pos < S, "capacity drop: position {} outside the sequence of {}", pos, S);
    return ((row / n) * S + pos) * k;
  };
  for (int64_t q = 0; q < G; ++q)
    for (int64_t row = 0; row < T; ++row)
      std::copy_n(all.begin() + (q * per + row * k), k, global.begin() + at(q, row));
  moe_drop_over_capacity(global, B, S, k, m.num_experts, cap);
  const int64_t me = ep_->rank();
  for (int64_t row = 0; row < T; ++row) std::copy_n(global.begin() + at(me, row), k, ids.begin() + row * k);
}

Tensor TpStepBase::moe_forward(int l, const Tensor& x_mid, TpMlpSaved* saved) {
  FP_CHECK(ep_ != nullptr && ep_->size() == dims_.expert_degree, "MoE layer without its expert axis of {} ranks",
           dims_.expert_degree);
  const MoeLayerWeights& mw = w_.moe[l];
  const MoeConfig& m = c_.moe;
  const int64_t h = dims_.h, E = m.num_experts, k = m.num_experts_per_tok;
  const bool split = !seq_par_ && tp_.size() > 1;  // replicated rows: this rank dispatches its block
  NormSaved norm = norm_forward(row_ctx_, w_.mlp_norm[l], x_mid);  // a2 [R, h]
  MoeShardSaved s;
  int64_t T = rows_;
  if (split) {
    const int64_t n = tp_seq_ / tp_.size();
    std::vector<int32_t> rows;
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t i = tp_.rank() * n; i < (tp_.rank() + 1) * n; ++i) rows.push_back(static_cast<int32_t>(b * tp_seq_ + i));
    T = static_cast<int64_t>(rows.size());
    s.rows = moe_upload_i32(be_, rows);
    s.norm.a = act({T, h});
    be_.gather_rows(norm.a, s.rows, nullptr, s.norm.a);
  } else {
    s.norm.a = norm.a;
  }
  const Tensor& a = s.norm.a;
  const int64_t M = T * k;
  const BlockContext lctx = moe_group_context(split ? ctx_ : row_ctx_, T);
  // ---- routing of this rank's rows (the single-rank layer's) ----
  MoeSaved& r = s.route;
  Tensor logits = act({T, E});
  be_.matmul(a, false, mw.router, true, logits);
  r.probs = act({T, E});
  r.weights = act({T, k});
  r.experts = Tensor::empty({T, k}, DType::kI32, MemCategory::kActivations);
  be_.moe_route_forward(logits, m.norm_topk_prob, r.probs, r.weights, r.experts);
  logits = Tensor();
  std::vector<int32_t> host_experts(static_cast<size_t>(M));
  be_.copy_to_host(r.experts, std::as_writable_bytes(std::span<int32_t>(host_experts)));
  const std::vector<int64_t> choices = moe_expert_choices(host_experts, E);  // before any capacity drop
  drop_over_capacity(host_experts, T, split || seq_par_);
  std::vector<int32_t> token_rows, slot_rows;
  moe_dispatch_order(host_experts, k, E, r.offsets, token_rows, slot_rows);
  const int64_t Mk = static_cast<int64_t>(token_rows.size());  // M less any dropped pairs
  r.token_rows = moe_upload_i32(be_, token_rows);
  r.slot_rows = moe_upload_i32(be_, slot_rows);
  {  // this rank's statistics for the aux loss
    Tensor ones = act({1, T}), sums = stat({1, E});
    be_.fill(1.0, ones);
    be_.matmul(ones, false, r.probs, false, sums);
    auto& counts = moe_stats_.counts[mw.sparse_index];
    counts.assign(static_cast<size_t>(E), 0);
    for (int64_t e = 0; e < E; ++e) counts[e] = choices[static_cast<size_t>(e)];
    moe_stats_.prob_sums[mw.sparse_index] = host_f64(be_, sums);
    moe_stats_.rows[mw.sparse_index] = T;
    moe_stats_.dropped[mw.sparse_index] = moe_dropped_count(host_experts);
  }
  r.row_weights = act({Mk, 1});
  be_.gather_rows(r.weights.reshape({M, 1}), r.slot_rows, nullptr, r.row_weights);
  // ---- the rows to their experts' ranks and back ----
  MoeAllToAll(be_, *ep_, dims_, dtype_, tp_.timer()).forward(lctx, mw, a, r, token_rows, s, saved != nullptr);
  Tensor out = act({T, h});
  be_.fill(0.0, out);
  be_.scatter_add_rows(r.expert_out, r.token_rows, &r.row_weights, out);
  if (mw.shared_gate.defined()) {
    // out += sigmoid(a Wsg^T) * shared(a): replicated weights, this rank's rows.
    r.shared_out = act({T, h});
    foldpar::mlp_forward(lctx, expert_mlp_weights(mw.shared), a, r.shared_out, saved != nullptr ? &r.shared_mlp : nullptr,
                         {}, 0.0f);
    Tensor gate_logit = act({T, 1});
    be_.matmul(a, false, mw.shared_gate, true, gate_logit);
    r.shared_gate = act({T, 1});
    be_.sigmoid_forward(gate_logit, r.shared_gate);
    std::vector<int32_t> identity(static_cast<size_t>(T));
    std::iota(identity.begin(), identity.end(), 0);
    r.identity_rows = moe_upload_i32(be_, identity);
    be_.scatter_add_rows(r.shared_out, r.identity_rows, &r.shared_gate, out);
  }
  Tensor y = out;
  if (split) {  // every tp rank's block: the replicated output [N, h]
    y = act({all_rows_, h});
    Tensor full = y.reshape({batch_, tp_seq_, h});
    tp_.all_gather_seq(out.reshape({batch_, T / batch_, h}), full);
  }
  be_.add_inplace(x_mid, y);  // x_out = x_mid + moe
  if (saved != nullptr) {
    saved->norm = std::move(norm);
    saved->moe = std::move(s);
  }
  return y;
}

Tensor TpStepBase::moe_backward(int l, const TpMlpSaved& saved, const Tensor& d_out) {
  const MoeLayerWeights& mw = w_.moe[l];
  MoeLayerWeights& gw = in_.grads->moe[l];
  const MoeShardSaved& s = saved.moe;
  const MoeSaved& r = s.route;
  const MoeConfig& m = c_.moe;
  const bool split = s.rows.defined();
  const Tensor& a = s.norm.a;
  const int64_t T = a.dim(0), h = dims_.h, k = m.num_experts_per_tok, M = T * k;
  const BlockContext lctx = moe_group_context(split ? ctx_ : row_ctx_, T);
  // This rank's rows of d(out): d_out is replicated over tp when split.
  Tensor dy = d_out;
  if (split) {
    dy = act({T, h});
    be_.gather_rows(d_out, s.rows, nullptr, dy);
  }
  Tensor d_a = act({T, h});
  be_.fill(0.0, d_a);
  Tensor d_weights = act({T, k});
  be_.fill(0.0, d_weights);
  Tensor d_weights_rows = d_weights.reshape({M, 1});
  {  // the combine's adjoint, then d(out) to the owners and d(in) back
    Tensor d_rows = moe_combine_backward(be_, r, dy, d_weights_rows);
    MoeAllToAll(be_, *ep_, dims_, dtype_, tp_.timer()).backward(lctx, mw, s, r, d_rows, d_a, gw);
  }
  // The replicated tensors' gradients: this rank's rows' part, summed over tp (over sp with
  // the rest of the step's gradients).
  auto sum_over_tp = [&](Tensor& partial, Tensor& grad) {
    tp_.all_reduce(partial);
    be_.add_inplace(partial, grad);
  };
  moe_replicated_backward(lctx, mw, r, a, dy, d_weights, moe_prob_grad_, d_a, gw, sum_over_tp);
  Tensor d_a2 = d_a;
  if (split) {  // every tp rank's block: the replicated d(a2) [N, h]
    d_a2 = act({all_rows_, h});
    Tensor full = d_a2.reshape({batch_, tp_seq_, h});
    tp_.all_gather_seq(d_a.reshape({batch_, T / batch_, h}), full);
  }
  // a2 = norm(x_mid); dx_mid = d_out + norm^T(d_a2).
  NormSaved norm = saved.norm;
  return norm_backward(row_ctx_, w_.mlp_norm[l], norm, d_a2, &d_out,
                       norm_grad(in_.grads->mlp_norm[l], static_cast<int>(c_.num_hidden_layers) + l));
}

Tensor TpStepBase::moe_forward_replicated(int l, const Tensor& x_mid) {
  FP_CHECK(!seq_par_ && in_.grads == nullptr && dims_.expert_degree == tp_.size(),
           "replicated MoE layer: a prefill on tp={} (experts over {} ranks)", tp_.size(), dims_.expert_degree);
  const MoeLayerWeights& mw = w_.moe[l];
  const MoeConfig& m = c_.moe;
  const int64_t N = rows_, h = dims_.h, E = m.num_experts, k = m.num_experts_per_tok, El = dims_.experts;
  NormSaved norm = norm_forward(row_ctx_, w_.mlp_norm[l], x_mid);  // every row, on every tp rank
  const Tensor& a = norm.a;
  Tensor logits = act({N, E}), probs = act({N, E}), weights = act({N, k});
  Tensor experts = Tensor::empty({N, k}, DType::kI32, MemCategory::kActivations);
  be_.matmul(a, false, mw.router, true, logits);
  be_.moe_route_forward(logits, m.norm_topk_prob, probs, weights, experts);
  std::vector<int32_t> host_experts(static_cast<size_t>(N * k));
  be_.copy_to_host(experts, std::as_writable_bytes(std::span<int32_t>(host_experts)));
  std::vector<int64_t> offsets;
  std::vector<int32_t> token_rows, slot_rows;
  moe_dispatch_order(host_experts, k, E, offsets, token_rows, slot_rows);
  // This rank's experts (or its f_e slice of one): their rows are one block of the order.
  const int64_t e0 = dims_.expert0(tp_.rank()), first = offsets[e0], last = offsets[e0 + El];
  Tensor y = act({N, h});
  be_.fill(0.0, y);
  if (last > first) {
    const std::vector<int32_t> own_tokens(token_rows.begin() + first, token_rows.begin() + last);
    const std::vector<int32_t> own_slots(slot_rows.begin() + first, slot_rows.begin() + last);
    const Tensor tokens = moe_upload_i32(be_, own_tokens), slots = moe_upload_i32(be_, own_slots);
    const int64_t R = last - first;
    Tensor in = act({R, h}), row_w = act({R, 1}), out = act({R, h});
    be_.gather_rows(a, tokens, nullptr, in);
    be_.gather_rows(weights.reshape({N * k, 1}), slots, nullptr, row_w);
    for (int64_t j = 0; j < El; ++j) {
      const int64_t begin = offsets[e0 + j] - first, end = offsets[e0 + j + 1] - first;
      if (begin == end) continue;
      Tensor o = out.narrow(begin, end);
      foldpar::mlp_forward(moe_group_context(ctx_, end - begin), expert_mlp_weights(mw.experts[j]),
                           in.narrow(begin, end), o, nullptr, {}, 0.0f);
    }
    be_.scatter_add_rows(out, tokens, &row_w, y);
  }
  tp_.all_reduce(y);  // every rank's experts (and an expert's slices)
  if (mw.shared_gate.defined()) {
    // y += sigmoid(a Wsg^T) * shared(a), once, after the sum (replicated weights, every row).
    Tensor z = act({N, h}), gate_logit = act({N, 1}), gate = act({N, 1});
    foldpar::mlp_forward(ctx_, expert_mlp_weights(mw.shared), a, z, nullptr, {}, 0.0f);
    be_.matmul(a, false, mw.shared_gate, true, gate_logit);
    be_.sigmoid_forward(gate_logit, gate);
    std::vector<int32_t> identity(static_cast<size_t>(N));
    std::iota(identity.begin(), identity.end(), 0);
    be_.scatter_add_rows(z, moe_upload_i32(be_, identity), &gate, y);
  }
  be_.add_inplace(x_mid, y);  // x_out = x_mid + moe
  return y;
}

MoeAux TpStepBase::sum_moe_stats(Communicator* dp, Communicator* expert_dp, int64_t* valid_tokens) {
  MoeAux sum = moe_stats_;
  // Counts (exact in f64), probability sums, rows and dropped pairs of every layer
  // (MoeAux::pack), and the valid targets over dp, in one all_reduce per axis.
  std::vector<double> packed = sum.pack();
  auto reduce = [&](Communicator& axis) {
    Tensor buf = moe_comm_from_host(be_, packed, DType::kF64);
    const auto t0 = std::chrono::steady_clock::now();
    tp_.timer().blocking(axis.all_reduce(buf.raw_data(), buf.raw_data(), packed.size(), DType::kF64, ReduceOp::kSum), t0);
    moe_comm_to_host(be_, buf, packed);
  };
  if (expert_dp != nullptr) {
    // ep = K G over K replicas: each replica's valid tokens from its model group's first rank.
    const int G = ep_->size() / (dp->size() / expert_dp->size());
    packed.push_back(ep_->rank() % G == 0 ? static_cast<double>(*valid_tokens) : 0.0);
    reduce(*ep_);
    if (expert_dp->size() > 1) reduce(*expert_dp);
    *valid_tokens = static_cast<int64_t>(packed.back());
    packed.pop_back();
  } else {
    if (!packed.empty() && ep_ != nullptr && ep_->size() > 1) reduce(*ep_);
    if (dp != nullptr && dp->size() > 1) {
      packed.push_back(static_cast<double>(*valid_tokens));
      reduce(*dp);
      *valid_tokens = static_cast<int64_t>(packed.back());
      packed.pop_back();
    }
  }
  sum.unpack(packed);
  return sum;
}

}  // namespace foldpar::megatron_detail
