// TSP mixture of experts (spec COMPOSITION.md section 3): attention stays TSP; in a sparse
// layer rank r owns the routed experts [r*E/D, (r+1)*E/D) whole (D <= E), or, when D > E,
// slice r % G of expert r / G's f_e (G = D/E ranks per expert: gate/up rows and down columns,
// so the expert's output is the sum of its G partial outputs, as TSP's MLP shards add up);
// ShardDims::expert0 / expert_group / expert_rows say which. The router [E, h] and the
// shared expert (with its gate) are replicated like the norm gains, their gradients summed
// over the axis. Each rank routes its own T tokens exactly as the single-rank layer does
// (model/moe_layer.cc: softmax, top k, ties to the lower index, dispatch order sorted by
// expert, stably), so the routing is that of the single-rank model, row for row.
//
// Scheme A (MoeDispatch::kAllToAll; parallel/moe_dispatch.h, shared with the Megatron
// baselines' expert parallelism): the dispatch order sorted by global expert id puts the
// rows for rank r's experts in one contiguous block; the per-expert counts go first (one
// all_to_all of E/D counts per peer), then each block to its owner (point-to-point, rows of
// h, zero-size blocks skipped on both sides, which both know from the counts). The owner
// reorders what came source-major into expert-major groups (gather_rows), runs each expert
// as one GEMM group, reorders back and returns the rows the same way; the home rank
// combines them with the routing weights. Adjoint: the same two exchanges carry d(out) to
// the owners and d(in) back. Split experts: expert e's rows go to each of its G ranks (the
// blocks overlap in the dispatch order), G partial outputs come back and are summed per row
// (combine_rows) before the weighted combine; backward, d(out) goes to all G and the G
// partial d(rows) add into their tokens (combine_tokens).
//
// Scheme C (MoeDispatch::kRing): each rank's E/D experts, packed in one block, travel TSP's
// weight ring (tsp_step.cc); at step j a rank applies the visiting block's experts to its own
// rows routed to them (no token moves, static shapes, exact balance). Adjoint: the weight
// ring again plus the gradient ring that carries each block's summed gradient home. With the
// experts over dp replicas (ep = K D) the same two rings run over the expert group's K D
// ranks (E/(K D) experts a block), each rank still applying them to its own rows. Split
// experts: the blocks are f_e slices, and an expert's G slices add into its rows' outputs
// (and, backward, into their d(rows)) as they pass.
//
// Scheme B (MoeDispatch::kGather): the normed rows, expert ids and routing weights of every
// rank are all-gathered (T rows per rank, static shapes); each rank runs its own experts on
// every token routed to them and the partial outputs [D*T, h] are reduce-scattered home.
// Adjoint: all-gather of dy, the experts' backward, reduce-scatter of d(rows) and of the
// routing-weight gradients [D*T, k]. Split experts: nothing changes but the weights; the
// reduce-scatter that sums the ranks' outputs also sums an expert's G partial outputs (and
// the partial <dy, out> of its routing weights' gradient).
//
// The aux-loss statistics of a layer (per-expert counts and probability sums of this rank's
// tokens) are kept per rank and summed over the axis once per step (sum_moe_stats), before
// the loss, and under dp=R over the replicas too: the count vector and the probability sums
// are then those of the single-rank model on the whole global batch.
#include <numeric>

#include "model/moe_weights.h"
#include "parallel/tsp/tsp_step.h"

namespace foldpar::tsp_detail {
namespace {

std::vector<double> host_f64(Backend& be, const Tensor& t) {
  std::vector<float> f(static_cast<size_t>(t.numel()));
  be.copy_to_host(t, std::as_writable_bytes(std::span<float>(f)));
  return std::vector<double>(f.begin(), f.end());
}

}  // namespace

MoeDispatch TspStep::moe_scheme() const {
  // auto: the training break-evens of spec COMPOSITION.md 3 on forward+backward bytes
  // (moe_dispatch_by_bytes) over the X ranks the dispatch runs over: the tsp axis (X = D), or
  // with the experts over dp replicas the expert group (X = ep = K D). The rule holds over the
  // group unchanged: each rank still routes its own T rows (T = rows_, its share of its own
  // replica's micro-batch) and every scheme runs over the group's X ranks, E/X whole experts a
  // rank (E divisible by ep, so G = 1). Per rank and sparse layer, forward elements:
  //   A  2 T k h (X-1)/X      (each routed row leaves for its owner w.p. (X-1)/X and returns)
  //   B  2 T h          (all-gather of the X T rows, reduce-scatter of the outputs)
  //   C  (X-1)/X E W_e        (the X blocks of E/X experts go round, W_e = 3 f_e h)
  // Training doubles A and B and triples C, so C < A iff 9 E f_e h < 4 T k h, i.e.
  // T > 2.25 E f_e / k (the (X-1)/X cancels: the same break-even as on tsp), and B < A iff
  // X < k, the tsp rule with D read as X. T, X, E, f_e and k are the same on every rank of
  // the group (its replicas hold equal shares of equal micro-batches: validate_layout divides
  // the batch by dp, and a step's micro-batches are of one size), so every rank picks the
  // same scheme, as it must: the group's ranks enter one scheme's exchanges together (the
  // ring's hops, the gather's collectives, the all-to-all's counts and rows), and two schemes
  // on one group would pair unlike calls and hang or mix buffers.
  const int X = model_.expert_group() != nullptr ? model_.expert_group()->size() : D_;
  const Layout::MoeDispatchOption d = opt_.moe_dispatch == Layout::MoeDispatchOption::kAuto
                                          ? moe_dispatch_by_bytes(c_.moe, rows_, X)
                                          : opt_.moe_dispatch;
  switch (d) {
    case Layout::MoeDispatchOption::kAllToAll: return MoeDispatch::kAllToAll;
    case Layout::MoeDispatchOption::kGather: return MoeDispatch::kGather;
    case Layout::MoeDispatchOption::kRing: return MoeDispatch::kRing;
    case Layout::MoeDispatchOption::kAuto: break;
  }
  return MoeDispatch::kAllToAll;  // not reached: moe_dispatch_by_bytes never answers auto
}

Tensor TspStep::pack_experts(const MoeLayerWeights& w) const {
  // The experts are views into their layer's block (moe_weights.cc): send it as it is.
  if (experts_are_block_views(w) && w.expert_block.dim(0) == dims_.experts * 3 * dims_.expert_rows)
    return w.expert_block;
  const int64_t h = dims_.h, fe = dims_.expert_rows, El = dims_.experts;
  const std::vector<ExpertWeights>& experts = w.experts;
  Tensor block = Tensor::empty({El * 3 * fe, h}, experts.empty() ? DType::kF32 : experts[0].w_gate.dtype(),
                               MemCategory::kComm);
  for (int64_t j = 0; j < El; ++j) {
    ExpertWeights v = expert_block(block, j);
    be_.copy(experts[j].w_gate, v.w_gate);
    be_.copy(experts[j].w_up, v.w_up);
    be_.copy(experts[j].w_down, v.w_down);
  }
  return block;
}

ExpertWeights TspStep::expert_block(const Tensor& block, int64_t j) const {
  return expert_in_block(block, j, dims_.expert_rows);
}

void TspStep::drop_over_capacity(std::vector<int32_t>& ids) {
  const MoeConfig& m = c_.moe;
  const int64_t B = batch_, Sl = local_seq_, S = Sl * D_, k = m.num_experts_per_tok, n = B * Sl * k;
  const int64_t cap = m.expert_capacity(S);
  if (cap == 0) return;
  FP_CHECK(static_cast<int64_t>(ids.size()) == n, "{} expert ids for {} rows of k={}", ids.size(), rows_, k);
  std::vector<int32_t> all = ids;
  if (D_ > 1) {
    Tensor send = moe_comm_from_host(be_, ids, DType::kI32), recv = comm_buffer({D_ * n}, DType::kI32);
    const auto t0 = std::chrono::steady_clock::now();
    blocking(comm_.all_gather(send.raw_data(), recv.raw_data(), static_cast<size_t>(n), DType::kI32), t0);
    moe_comm_to_host(be_, recv, all);
    // A dry run moves no data: take the plan's routing assumption, every rank alike.
    if (!recv.has_storage())
      for (int64_t q = 0; q < D_; ++q) std::copy(ids.begin(), ids.end(), all.begin() + q * n);
  }
  // Rank q's row (b, i) is token gathered_pos_[q Sl + i] of sequence b.
  std::vector<int32_t> global(static_cast<size_t>(B * S * k));
  const auto at = [&](int64_t q, int64_t b, int64_t i) {
    return (b * S + gathered_pos_[static_cast<size_t>(q * Sl + i)]) * k;
  };
  for (int64_t q = 0; q < D_; ++q)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Sl; ++i)
        std::copy_n(all.begin() + (q * n + (b * Sl + i) * k), k, global.begin() + at(q, b, i));
  moe_drop_over_capacity(global, B, S, k, c_.moe.num_experts, cap);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Sl; ++i) std::copy_n(global.begin() + at(p_, b, i), k, ids.begin() + (b * Sl + i) * k);
}

void TspStep::record_moe_stats(const MoeLayerWeights& w, const std::vector<int64_t>& choices, int64_t dropped,
                               const Tensor& probs) {
  if (moe_stats_ == nullptr) return;
  const int64_t E = c_.moe.num_experts, T = rows_;
  Tensor ones = act({1, T}), sums = stat({1, E});  // f32 sums of bf16 probabilities too
  be_.fill(1.0, ones);
  be_.matmul(ones, false, probs, false, sums);
  auto& counts = moe_stats_->counts[w.sparse_index];
  counts.assign(static_cast<size_t>(E), 0);
  for (int64_t e = 0; e < E; ++e) counts[e] = choices[static_cast<size_t>(e)];
  moe_stats_->prob_sums[w.sparse_index] = host_f64(be_, sums);
  moe_stats_->rows[w.sparse_index] = T;
  moe_stats_->dropped[w.sparse_index] = dropped;
}

MoeAux TspStep::sum_moe_stats(const MoeAux& local, Communicator* data_axis, int64_t* valid_tokens) {
  // Counts (exact in f64), probability sums and rows of every layer in one all-reduce per axis.
  std::vector<double> packed = local.pack();
  auto reduce = [&](Communicator& axis) {
    Tensor buf = moe_comm_from_host(be_, packed, DType::kF64);
    const auto t0 = std::chrono::steady_clock::now();
    blocking(axis.all_reduce(buf.raw_data(), buf.raw_data(), packed.size(), DType::kF64, ReduceOp::kSum), t0);
    moe_comm_to_host(be_, buf, packed);
  };
  if (Communicator* edp = model_.expert_data(); edp != nullptr) {
    // Experts over K dp replicas: over the expert group (each replica's valid targets from its
    // tsp rank 0), then over the replicas holding the same experts: every rank of dp x tsp once.
    packed.push_back(comm_.rank() == 0 ? static_cast<double>(*valid_tokens) : 0.0);
    for (Communicator* axis : {model_.expert_group(), edp})
      if (axis->size() > 1) reduce(*axis);
    *valid_tokens = static_cast<int64_t>(packed.back());
    packed.pop_back();
  } else {
    if (!packed.empty()) reduce(comm_);
    if (data_axis != nullptr && data_axis->size() > 1) {
      // The replicas' sums (and valid targets): the global batch's statistics on every rank.
      packed.push_back(static_cast<double>(*valid_tokens));
      reduce(*data_axis);
      *valid_tokens = static_cast<int64_t>(packed.back());
      packed.pop_back();
    }
  }
  MoeAux sum = local;
  sum.unpack(packed);
  return sum;
}

void TspStep::sum_into(Tensor& partial, Tensor& grad) {
  const auto t0 = std::chrono::steady_clock::now();
  blocking(comm_.all_reduce(partial.raw_data(), partial.raw_data(), static_cast<size_t>(partial.numel()), DType::kF32,
                            ReduceOp::kSum),
           t0);
  be_.add_inplace(partial, grad);
}

// ---- forward ----

Tensor TspStep::moe_forward(int l, const ShardedWeights& w, const Tensor& x_mid, MoeShardSaved* saved) {
  const MoeLayerWeights& mw = w.moe[l];
  const MoeConfig& m = c_.moe;
  const int64_t T = rows_, h = dims_.h, E = m.num_experts, k = m.num_experts_per_tok, M = T * k, El = dims_.experts;
  MoeShardSaved s;
  s.scheme = moe_scheme();
  s.norm = norm_forward(ctx_, w.mlp_norm[l], x_mid);  // a2 [T, h]
  const Tensor& a = s.norm.a;
  Tensor y = residual_forward(ctx_, x_mid);
  // ---- routing of this rank's tokens ----
  Tensor logits = act({T, E});
  be_.matmul(a, false, mw.router, true, logits);
  MoeSaved& r = s.route;
  r.probs = act({T, E});
  r.weights = act({T, k});
  r.experts = Tensor::empty({T, k}, DType::kI32, MemCategory::kActivations);
  be_.moe_route_forward(logits, m.norm_topk_prob, r.probs, r.weights, r.experts);
  logits = Tensor();
  std::vector<int32_t> host_experts(static_cast<size_t>(M));
  be_.copy_to_host(r.experts, std::as_writable_bytes(std::span<int32_t>(host_experts)));
  const std::vector<int64_t> choices = moe_expert_choices(host_experts, E);  // before any capacity drop
  drop_over_capacity(host_experts);
  std::vector<int32_t> token_rows, slot_rows;
  moe_dispatch_order(host_experts, k, E, r.offsets, token_rows, slot_rows);
  const int64_t Mk = static_cast<int64_t>(token_rows.size());  // M less the dropped pairs
  r.token_rows = moe_upload_i32(be_, token_rows);
  r.slot_rows = moe_upload_i32(be_, slot_rows);
  record_moe_stats(mw, choices, moe_dropped_count(host_experts), r.probs);
  r.row_weights = act({Mk, 1});
  be_.gather_rows(r.weights.reshape({M, 1}), r.slot_rows, nullptr, r.row_weights);

  if (s.scheme == MoeDispatch::kAllToAll) {
    // ---- counts, then each rank's rows to its experts' owners and back (parallel/moe_dispatch.h) ----
    MoeAllToAll(be_, expert_comm(), dims_, opt_.dtype, timer_).forward(ctx_, mw, a, r, token_rows, s, saved != nullptr);
    be_.scatter_add_rows(r.expert_out, r.token_rows, &r.row_weights, y);
  } else if (s.scheme == MoeDispatch::kRing) {
    // ---- the experts come to the tokens: rank q's block of E/D experts at ring step j ----
    r.dispatched = act({Mk, h});
    be_.gather_rows(a, r.token_rows, nullptr, r.dispatched);
    // Split experts: the D/E slices of an expert visit one after another and their partial
    // outputs add up in the expert's rows (TSP's MLP ring, per expert).
    const bool split = dims_.expert_group > 1;
    r.expert_out = act({Mk, h});
    if (split) be_.fill(0.0, r.expert_out);
    // The ring runs over expert_comm(): the tsp axis, or the expert group of ep ranks when the
    // experts spread over dp replicas (its ranks of other replicas hold other tokens; tokens
    // never move, so each rank still meets every expert once).
    WeightRing ring = weight_ring(pack_experts(mw), &expert_comm());
    r.expert_mlp.resize(static_cast<size_t>(ring.steps() * El));  // per piece: ring owner q's i-th (slice of an) expert
    // MPI progresses only inside MPI calls: advance the hop between the experts' GEMMs, as
    // the dense MLP ring does (tsp_mlp.cc), or the block moves only at the wait.
    const auto progress = [&ring] { StepTimer::poke(ring.hop); };
    for (int j = 0; j < ring.steps(); ++j) {
      weight_ring_send(ring, j);
      const int q = ring.owner(j);
      for (int64_t i = 0; i < El; ++i) {
        const int64_t e = dims_.expert0(q) + i, begin = r.offsets[e], end = r.offsets[e + 1];
        if (begin == end) continue;
        Tensor out = r.expert_out.narrow(begin, end);
        foldpar::mlp_forward(moe_group_context(ctx_, end - begin), expert_mlp_weights(expert_block(ring.cur, i)),
                             r.dispatched.narrow(begin, end), out,
                             saved != nullptr ? &r.expert_mlp[static_cast<size_t>(q * El + i)] : nullptr, progress,
                             split ? 1.0f : 0.0f);
        progress();
      }
      weight_ring_advance(ring, j);
    }
    be_.scatter_add_rows(r.expert_out, r.token_rows, &r.row_weights, y);
  } else {
    // ---- every rank's rows, ids and weights; this rank's experts over all of them (over the
    // expert group when the experts spread over dp replicas: X = its ranks) ----
    Communicator& ec = expert_comm();
    const int64_t X = ec.size();
    Tensor all_a = comm_buffer({X * T, h}, a.dtype());
    Tensor all_w = comm_buffer({X * T, k}, r.weights.dtype());
    std::vector<int32_t> all_experts(static_cast<size_t>(X * M));
    const auto t0 = std::chrono::steady_clock::now();
    blocking(ec.all_gather(a.raw_data(), all_a.raw_data(), static_cast<size_t>(a.numel()), a.dtype()), t0);
    blocking(ec.all_gather(r.weights.raw_data(), all_w.raw_data(), static_cast<size_t>(M), r.weights.dtype()), t0);
    Tensor all_ids = comm_buffer({X * M}, DType::kI32);
    // The ids after any capacity drop (dropped slots are no expert's).
    const Tensor ids = c_.moe.capacity_factor > 0 ? moe_upload_i32(be_, host_experts) : r.experts;
    blocking(ec.all_gather(ids.raw_data(), all_ids.raw_data(), static_cast<size_t>(M), DType::kI32), t0);
    moe_comm_to_host(be_, all_ids, all_experts);
    // The slots of the gathered tokens routed to this rank's experts, grouped by expert.
    std::vector<int32_t> g_token, g_slot;
    s.expert_offsets.assign(static_cast<size_t>(El) + 1, 0);
    for (int64_t j = 0; j < El; ++j) {
      const int32_t e = static_cast<int32_t>(dims_.expert0(ec.rank()) + j);
      for (size_t q = 0; q < all_experts.size(); ++q)
        if (all_experts[q] == e) {
          g_token.push_back(static_cast<int32_t>(q / k));
          g_slot.push_back(static_cast<int32_t>(q));
        }
      s.expert_offsets[j + 1] = static_cast<int64_t>(g_token.size());
    }
    const int64_t R = static_cast<int64_t>(g_token.size());
    s.g_token = moe_upload_i32(be_, g_token);
    s.g_slot = moe_upload_i32(be_, g_slot);
    s.expert_in = act({R, h});
    s.g_weight = act({R, 1});
    if (R > 0) {
      be_.gather_rows(all_a, s.g_token, nullptr, s.expert_in);
      be_.gather_rows(all_w.reshape({X * M, 1}), s.g_slot, nullptr, s.g_weight);
    }
    all_a = Tensor();
    s.g_out = act({R, h});
    s.expert_mlp.resize(static_cast<size_t>(El));
    for (int64_t j = 0; j < El; ++j) {
      const int64_t begin = s.expert_offsets[j], end = s.expert_offsets[j + 1];
      if (begin == end) continue;
      Tensor out = s.g_out.narrow(begin, end);
      foldpar::mlp_forward(moe_group_context(ctx_, end - begin), expert_mlp_weights(mw.experts[j]), s.expert_in.narrow(begin, end),
                           out, saved != nullptr ? &s.expert_mlp[j] : nullptr, {}, 0.0f);
    }
    Tensor partial = comm_buffer({X * T, h}, a.dtype());
    be_.fill(0.0, partial);
    if (R > 0) be_.scatter_add_rows(s.g_out, s.g_token, &s.g_weight, partial);
    Tensor mine = comm_buffer({T, h}, a.dtype());
    const auto t1 = std::chrono::steady_clock::now();
    blocking(ec.reduce_scatter(partial.raw_data(), mine.raw_data(), static_cast<size_t>(T * h), a.dtype(),
                               ReduceOp::kSum),
             t1);
    be_.add_inplace(mine, y);
  }
  if (mw.shared_gate.defined()) {
    // y += sigmoid(a Wsg^T) * shared(a): replicated weights, this rank's rows.
    r.shared_out = act({T, h});
    foldpar::mlp_forward(ctx_, expert_mlp_weights(mw.shared), a, r.shared_out, saved != nullptr ? &r.shared_mlp : nullptr, {},
                         0.0f);
    Tensor gate_logit = act({T, 1});
    be_.matmul(a, false, mw.shared_gate, true, gate_logit);
    r.shared_gate = act({T, 1});
    be_.sigmoid_forward(gate_logit, r.shared_gate);
    std::vector<int32_t> identity(static_cast<size_t>(T));
    std::iota(identity.begin(), identity.end(), 0);
    r.identity_rows = moe_upload_i32(be_, identity);
    be_.scatter_add_rows(r.shared_out, r.identity_rows, &r.shared_gate, y);
  }
  if (saved != nullptr) *saved = std::move(s);
  return y;
}

// ---- backward ----

Tensor TspStep::moe_backward(int l, const ShardedWeights& w, const MoeShardSaved& s, const Tensor& dy,
                             ShardedWeights& grads) {
  const MoeLayerWeights& mw = w.moe[l];
  MoeLayerWeights& gw = grads.moe[l];
  const MoeConfig& m = c_.moe;
  const MoeSaved& r = s.route;
  const int64_t T = rows_, h = dims_.h, k = m.num_experts_per_tok, M = T * k, El = dims_.experts;
  const Tensor& a = s.norm.a;
  Tensor d_a = act({T, h});
  be_.fill(0.0, d_a);
  Tensor d_weights = act({T, k});
  be_.fill(0.0, d_weights);
  Tensor d_weights_rows = d_weights.reshape({M, 1});

  auto experts_backward = [&](const Tensor& d_out, Tensor& d_in) {
    for (int64_t j = 0; j < El; ++j) {
      const int64_t begin = s.expert_offsets[j], end = s.expert_offsets[j + 1];
      if (begin == end) continue;
      Tensor d_rows = d_in.narrow(begin, end);
      MlpWeights ge = expert_mlp_weights(gw.experts[j]);  // the owner's gradient: no sum needed
      foldpar::mlp_backward(moe_group_context(ctx_, end - begin), expert_mlp_weights(mw.experts[j]), s.expert_mlp[j],
                            s.expert_in.narrow(begin, end), d_out.narrow(begin, end), d_rows, ge, 1.0f);
    }
  };

  if (s.scheme == MoeDispatch::kAllToAll) {
    // The combine's adjoint at home, then d(out) to the owners.
    Tensor d_out = moe_combine_backward(be_, r, dy, d_weights_rows);
    MoeAllToAll(be_, expert_comm(), dims_, opt_.dtype, timer_).backward(ctx_, mw, s, r, d_out, d_a, gw);
  } else if (s.scheme == MoeDispatch::kRing) {
    // The combine's adjoint as in A; then the weight ring again, and the gradient ring (the
    // weight ring's adjoint) carrying each block's summed gradient home.
    Tensor d_out = moe_combine_backward(be_, r, dy, d_weights_rows);
    Tensor d_dispatched = act({r.token_rows.numel(), h});  // the dispatched pairs (M less any dropped)
    be_.fill(0.0, d_dispatched);
    // Over the expert group when ep > D: the home block's gradient then sums the rows of all
    // K replicas of the group (as the a2a owner's does); the trainer's sum over edp (the dp/K
    // replicas holding the same experts) completes it, so no replica's rows count twice.
    WeightRing ring = weight_ring(pack_experts(mw), &expert_comm());
    const Shape block_shape = ring.cur.shape();
    // This rank's experts' gradient block itself where the gradients are laid out as one
    // (ShardedGrads): the step-0 products accumulate into it and the ring's sum lands in it.
    const bool grads_in_block = experts_are_block_views(gw) && gw.expert_block.shape() == block_shape &&
                                gw.expert_block.dtype() == DType::kF32;
    Tensor own_grad = grads_in_block ? gw.expert_block : comm_buffer(block_shape, DType::kF32);
    if (!grads_in_block) be_.fill(0.0, own_grad);
    GradRing gring = grad_ring(*ring.axis);
    for (int j = 0; j < ring.steps(); ++j) {
      weight_ring_send(ring, j);
      const int q = ring.owner(j);
      Tensor partial = grad_ring_partial(own_grad, j, block_shape);
      if (j > 0) be_.fill(0.0, partial);
      for (int64_t i = 0; i < El; ++i) {
        const int64_t e = dims_.expert0(q) + i, begin = r.offsets[e], end = r.offsets[e + 1];
        if (begin == end) continue;
        Tensor d_rows = d_dispatched.narrow(begin, end);  // accumulates the D/E slices' of a split expert
        ExpertWeights gb = expert_block(partial, i);
        MlpWeights ge = expert_mlp_weights(gb);
        foldpar::mlp_backward(moe_group_context(ctx_, end - begin), expert_mlp_weights(expert_block(ring.cur, i)),
                              r.expert_mlp[static_cast<size_t>(q * El + i)], r.dispatched.narrow(begin, end),
                              d_out.narrow(begin, end), d_rows, ge, 1.0f);
        // Both hops (this step's weights, the previous step's gradient) between experts.
        StepTimer::poke(ring.hop);
        StepTimer::poke(gring.hop);
      }
      grad_ring_send(gring, j, partial);
      weight_ring_advance(ring, j);
    }
    grad_ring_finish(gring, own_grad);
    for (int64_t i = 0; i < El && !grads_in_block; ++i) {
      const ExpertWeights g = expert_block(own_grad, i);
      be_.add_inplace(g.w_gate, gw.experts[i].w_gate);
      be_.add_inplace(g.w_up, gw.experts[i].w_up);
      be_.add_inplace(g.w_down, gw.experts[i].w_down);
    }
    be_.scatter_add_rows(d_dispatched, r.token_rows, nullptr, d_a);
  } else {
    // all_gather's adjoint is reduce_scatter and back (over the expert group, as forward).
    Communicator& ec = expert_comm();
    const int64_t X = ec.size();
    Tensor all_dy = comm_buffer({X * T, h}, dy.dtype());
    const auto t0 = std::chrono::steady_clock::now();
    blocking(ec.all_gather(dy.raw_data(), all_dy.raw_data(), static_cast<size_t>(dy.numel()), dy.dtype()), t0);
    const int64_t R = s.expert_in.dim(0);
    Tensor dy_rows = act({R, h}), d_out = act({R, h}), d_row_w = act({R, 1}), d_in = act({R, h});
    Tensor d_all_a = comm_buffer({X * T, h}, dy.dtype()), d_all_w = comm_buffer({X * M, 1}, dy.dtype());
    be_.fill(0.0, d_all_a);
    be_.fill(0.0, d_all_w);
    be_.fill(0.0, d_in);
    if (R > 0) {
      be_.gather_rows(all_dy, s.g_token, nullptr, dy_rows);
      be_.rows_dot(dy_rows, s.g_out, d_row_w);
      be_.gather_rows(all_dy, s.g_token, &s.g_weight, d_out);
      be_.scatter_add_rows(d_row_w, s.g_slot, nullptr, d_all_w);
    }
    all_dy = Tensor();
    experts_backward(d_out, d_in);
    if (R > 0) be_.scatter_add_rows(d_in, s.g_token, nullptr, d_all_a);
    Tensor mine_a = comm_buffer({T, h}, dy.dtype()), mine_w = comm_buffer({M, 1}, dy.dtype());
    const auto t1 = std::chrono::steady_clock::now();
    blocking(ec.reduce_scatter(d_all_a.raw_data(), mine_a.raw_data(), static_cast<size_t>(T * h), dy.dtype(),
                               ReduceOp::kSum),
             t1);
    blocking(ec.reduce_scatter(d_all_w.raw_data(), mine_w.raw_data(), static_cast<size_t>(M), dy.dtype(),
                               ReduceOp::kSum),
             t1);
    be_.add_inplace(mine_a, d_a);
    be_.add_inplace(mine_w, d_weights_rows);
  }
  // ---- the router and the shared expert (replicated): this rank's rows' part, summed ----
  static const std::vector<std::vector<double>> kNoAux;
  moe_replicated_backward(ctx_, mw, r, a, dy, d_weights, moe_prob_grad_ != nullptr ? *moe_prob_grad_ : kNoAux, d_a, gw,
                          [&](Tensor& partial, Tensor& grad) { sum_into(partial, grad); });
  return norm_backward(ctx_, w.mlp_norm[l], s.norm, d_a, &dy, norm_partials_[c_.num_hidden_layers + l]);
}

}  // namespace foldpar::tsp_detail
