// TSP attention (spec 4.1 and 5): the broadcast schedule and its adjoint.
//
// Forward, for every unit u = (shard r, bucket b) in the same order on every rank:
//   W_r = broadcast(packed attention shard, root r)        fwd: broadcast; bwd: reduce to r
//   q, k, v = norm(x_p) Wq/Wk/Wv of the bucket's heads; RoPE at global positions
//   K, V = all_gather(k, v) in rank order                  fwd: all_gather; bwd: reduce_scatter
//   y_p += attention(q, K, V) Wo^T of those heads          (local; no all-reduce)
// The attention variants are replicated (sharded_weights.h): a unit applies its heads' q/k/v
// bias slices and the shared q/k norm gains (per head, before RoPE) to its projections of
// the local tokens, and the o bias is added once per token (with unit 0). Their gradients
// are every head's over the local tokens, summed over the axis after the step
// (sum_norm_partials), so every rank applies the same update.
// With overlap the broadcast of shard r+1 starts once shard r-1 is done with its buffer,
// and the all-gather of unit u+1 starts before the attention of unit u.
// Under the zero-bubble schedule the backward's weight products, the reduces and the KV
// replicas' zeroing and copy are queued in this order and run in W (TspStep::set_weight_grads).
// KV replicas (n_kv < D, ShardDims::kv_group = D/n_kv ranks share one KV head; docs/tsp.md
// section 3): the rounds r of one group read the same K/V. Its first round projects and
// all-gathers them; the group's other rounds reuse that K/V (their local k, v projections
// are recomputed, unused, by qkv_forward). Backward: every round's dK/dV of the group are
// summed locally; the group's last round reduce-scatters them once and runs the k/v
// backward, so its reduce brings owner r1 (the last) the whole wk/wv gradient; the other
// rounds send zero wk/wv rows; after the layer r1 copies its wk/wv gradient rows to the
// group's other members (copy_kv_replica), which keeps the replicas bit-identical. With head
// buckets the group is its units (round, bucket): every bucket of a round shares the rank's
// one KV head, so "first" and "last" are the group's first and last units
// (kv_group_first_unit, kv_group_last_unit).
#include <cmath>
#include <memory>

#include "parallel/tsp/tsp_step.h"

namespace foldpar::tsp_detail {
namespace {

// A unit's local q/k/v projections and gathered K/V.
struct UnitTensors {
  Tensor q, k, v;            // [B, S/D, heads_b | kvh_b, d]
  Tensor k_full, v_full;     // [B, S, kvh_b, d]
  QkvSaved normed;           // q/k norms: q_raw, k_raw and their rstd (q, k, v moved out)
  std::vector<CommRequest> gather;
};

}  // namespace

void TspStep::start_shard_broadcast(ShardBroadcast& bc, int r, const Tensor& own, Tensor* keep_into,
                                    const Tensor* kept) {
  if (r == p_) {
    bc.shard[r] = own;
    if (kept != nullptr) return;  // every other rank kept its copy: nothing to send
  } else if (kept != nullptr) {
    bc.shard[r] = *kept;
    return;  // nothing to move
  } else if (keep_into != nullptr) {
    bc.shard[r] = comm_buffer({dims_.attn_rows(), dims_.h}, opt_.dtype);
    *keep_into = bc.shard[r];
  } else {
    Tensor& buf = bc.buffers[r % 2];
    if (!buf.defined()) buf = comm_buffer({dims_.attn_rows(), dims_.h}, opt_.dtype);
    bc.shard[r] = buf;
  }
  // The root only reads its buffer; the interface takes void* for every rank.
  bc.request = comm_.ibroadcast(const_cast<void*>(bc.shard[r].raw_data()), static_cast<size_t>(dims_.attn_elems()),
                                bc.shard[r].dtype(), r);
}

Tensor TspStep::attention_forward(int l, const ShardedWeights& w, const Tensor& x, AttnSaved* s) {
  const int64_t d = dims_.d, B = batch_, Sl = local_seq_, S = Sl * D_;
  const int nb = opt_.head_buckets, units = D_ * nb;
  const NormSaved norm = norm_forward(ctx_, w.attn_norm[l], x);  // a1 [T, h]
  const Tensor& a1 = norm.a;
  Tensor y = residual_forward(ctx_, x);  // [T, h]
  if (s != nullptr) *s = AttnSaved{norm, {}, {}, {}, {}, {}, {}, {}, std::vector<Tensor>(static_cast<size_t>(D_)), {}};

  // ---- weights: shard r lives in the owner's parameter tensor or in a broadcast buffer ----
  ShardBroadcast bc(D_);
  std::vector<Tensor>& shard = bc.shard;
  CommRequest& w_req = bc.request;
  const bool keep = opt_.keep_weights && s != nullptr;
  auto start_bcast = [&](int r) { start_shard_broadcast(bc, r, w.attn[l], keep ? &s->weights[r] : nullptr, nullptr); };
  Tensor group_k_full, group_v_full;  // KV replicas: the group's K/V, gathered by its first round

  // ---- one unit: projections, RoPE, and the start of its K/V all-gather ----
  auto project = [&](int u) {
    const int r = u / nb, b = u % nb;
    const BucketWeights bw = bucket_weights(shard[r], b);
    QkvWeights qw = qkv_view(bw);  // the bucket's heads, with their biases and the q/k norms if any
    const int64_t kv_head0 = dims_.kv_head0(r) + bucket_kv0(b);
    const bool reuse = !kv_group_first_unit(r, b);  // KV replicas: the group's K/V are here
    attach_attn_variants(w, l, r * dims_.heads + b * heads_b_, heads_b_, kv_head0, kvh_b_, qw);
    QkvSaved qkv = qkv_forward(ctx_, qw, a1);
    UnitTensors t;
    t.q = std::move(qkv.q);
    t.k = std::move(qkv.k);
    t.v = std::move(qkv.v);
    if (qw.q_norm.defined()) t.normed = std::move(qkv);
    if (reuse) {
      t.k_full = group_k_full;
      t.v_full = group_v_full;
      return t;
    }
    if (kv_cache_ != nullptr) kv_cache_->store_prefill(be_, l, kv_head0, t.k, t.v);
    t.k_full = comm_buffer({B, S, kvh_b_, d}, opt_.dtype);
    t.v_full = comm_buffer({B, S, kvh_b_, d}, opt_.dtype);
    if (dims_.replicated_kv()) {
      group_k_full = t.k_full;
      group_v_full = t.v_full;
    }
    t.gather = start_gather(t.k, t.k_full);
    std::vector<CommRequest> gv = start_gather(t.v, t.v_full);
    for (CommRequest& req : gv) t.gather.push_back(std::move(req));
    if (!opt_.overlap) wait_all(t.gather);
    return t;
  };

  start_bcast(0);
  wait(w_req);
  if (opt_.overlap && D_ > 1) start_bcast(1);
  UnitTensors cur = project(0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int u = 0; u < units; ++u) {
    const int r = u / nb;
    UnitTensors next;
    if (u + 1 < units) {
      const int rn = (u + 1) / nb;
      if (rn != r) {
        if (!opt_.overlap) start_bcast(rn);
        wait(w_req);
      }
      next = project(u + 1);
    }
    wait_all(cur.gather);
    Tensor attn = act({B, Sl, heads_b_, d}), lse = stat({B, heads_b_, Sl});
    const AttentionArgs args{&cur.q, &cur.k_full, &cur.v_full, &q_pos_, &k_pos_, scale, ctx_.config->sliding_window};
    be_.attention_forward(args, attn, lse);
    poke(next.gather);
    LinearView wo = wo_view(bucket_weights(shard[r], u % nb));
    if (u == 0 && static_cast<size_t>(l) < w.o_bias.size()) wo.b = w.o_bias[l];  // once per token, not per shard
    attn_output_forward(ctx_, wo, attn, y);
    // Shard r's buffer is free once its last unit is done: prefetch shard r+2 into it.
    if (opt_.overlap && u % nb == nb - 1 && r + 2 < D_) start_bcast(r + 2);
    if (s != nullptr) {
      s->q.push_back(cur.q);
      s->k.push_back(cur.k);
      s->v.push_back(cur.v);
      s->attn.push_back(attn);
      s->lse.push_back(lse);
      if (cur.normed.q_raw.defined()) s->normed.push_back(std::move(cur.normed));
      if (opt_.keep_kv) {
        s->k_full.push_back(cur.k_full);
        s->v_full.push_back(cur.v_full);
      }
    }
    cur = std::move(next);
  }
  return y;
}

Tensor TspStep::attention_backward(int l, const ShardedWeights& w, const AttnSaved& s, const Tensor& d_out,
                                   ShardedWeights& grads) {
  const int64_t h = dims_.h, d = dims_.d, B = batch_, Sl = local_seq_, T = rows_, S = Sl * D_;
  const int nb = opt_.head_buckets;
  const size_t shard_elems = static_cast<size_t>(dims_.attn_elems());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Tensor d_a1 = act({T, h});
  be_.fill(0.0, d_a1);

  // ---- weights again: kept from forward, or broadcast again with one shard prefetched ----
  ShardBroadcast bc(D_);
  std::vector<Tensor>& shard = bc.shard;
  CommRequest& w_req = bc.request;
  auto start_bcast = [&](int r) {
    start_shard_broadcast(bc, r, w.attn[l], nullptr, opt_.keep_weights ? &s.weights[r] : nullptr);
  };
  // ---- packed weight-gradient partials, reduced to their owner: now, or in W behind the
  // deferred products (after_products), in the step's two deferred partial buffers ----
  const bool deferred = ctx_.weight_grads != nullptr;
  Tensor gbuf[2];
  auto g_req = std::make_shared<CommRequest>();
  // KV replicas: the group's K/V (gathered by its first round) and its rounds' dK/dV sums.
  const bool rep = dims_.replicated_kv();
  Tensor group_k_full, group_v_full, dk_sum, dv_sum;
  // K/V gathered again (not kept) for the units that start a KV group: with overlap the
  // next unit's gather is posted during this unit's backward (below), as the forward does.
  struct Regather {
    int unit = -1;
    Tensor k_full, v_full;
    std::vector<CommRequest> gather;
  };
  auto needs_gather = [&](int u) { return !opt_.keep_kv && u < D_ * nb && kv_group_first_unit(u / nb, u % nb); };
  auto start_regather = [&](int u) {
    Regather g;
    g.unit = u;
    g.k_full = comm_buffer({B, S, kvh_b_, d}, opt_.dtype);
    g.v_full = comm_buffer({B, S, kvh_b_, d}, opt_.dtype);
    g.gather = start_gather(s.k[static_cast<size_t>(u)], g.k_full);
    std::vector<CommRequest> gv = start_gather(s.v[static_cast<size_t>(u)], g.v_full);
    for (CommRequest& req : gv) g.gather.push_back(std::move(req));
    return g;
  };
  Regather next_kv;  // the prefetched gather (overlap), of the next unit that needs one

  start_bcast(0);
  if (opt_.overlap && needs_gather(0)) next_kv = start_regather(0);
  wait(w_req);
  for (int r = 0; r < D_; ++r) {
    if (opt_.overlap && r + 1 < D_) start_bcast(r + 1);
    // The owner accumulates straight into its gradient and reduces in place.
    Tensor g;
    if (r == p_) {
      g = grads.attn[l];
    } else if (deferred) {
      g = deferred_partial(deferred_attn_, r % 2, {dims_.attn_rows(), h});
    } else {
      if (!gbuf[r % 2].defined()) gbuf[r % 2] = comm_buffer({dims_.attn_rows(), h}, DType::kF32);
      g = gbuf[r % 2];
    }
    const float g_beta = r == p_ ? 1.0f : 0.0f;
    for (int b = 0; b < nb; ++b) {
      const size_t u = static_cast<size_t>(r * nb + b);
      const BucketWeights bw = bucket_weights(shard[r], b);
      BucketWeights gw = bucket_weights(g, b);
      const bool group_first = kv_group_first_unit(r, b), group_last = kv_group_last_unit(r, b);
      // K/V of the unit: kept, the KV group's (gathered by its first round), or gathered
      // again from the saved local k, v.
      Tensor k_full, v_full;
      if (opt_.keep_kv) {
        k_full = s.k_full[u];
        v_full = s.v_full[u];
      } else if (!group_first) {
        k_full = group_k_full;
        v_full = group_v_full;
      } else {
        Regather cur = next_kv.unit >= 0 ? std::move(next_kv) : start_regather(static_cast<int>(u));
        next_kv = Regather();
        FP_CHECK(cur.unit == static_cast<int>(u), "K/V re-gather of unit {} consumed at unit {}", cur.unit, u);
        wait_all(cur.gather);
        k_full = cur.k_full;
        v_full = cur.v_full;
        if (rep && !group_last) {
          group_k_full = k_full;
          group_v_full = v_full;
        }
      }
      // The unit's bias gradients go to a zeroed scratch (written with g_beta, the weights'
      // rule) and are then added into the step's partials, which accumulate over the
      // micro-batches a pipeline stage runs on one step.
      UnitBiasGrads ub = unit_bias_grads();
      LinearView g_wo = wo_view(gw);
      // The o bias was added once per token (unit 0): its gradient, d_out's column sums, once.
      if (u == 0 && static_cast<size_t>(l) < variant_partials_.o_bias.size()) g_wo.b = ub.o;
      Tensor d_attn = attn_output_backward(ctx_, wo_view(bw), s.attn[u], d_out, g_wo, g_beta);  // [B, S/D, heads_b, d]
      Tensor dq = act({B, Sl, heads_b_, d});
      Tensor dk_full = comm_buffer({B, S, kvh_b_, d}, opt_.dtype), dv_full = comm_buffer({B, S, kvh_b_, d}, opt_.dtype);
      const AttentionArgs args{&s.q[u], &k_full, &v_full, &q_pos_, &k_pos_, scale, ctx_.config->sliding_window};
      be_.attention_backward(args, s.attn[u], s.lse[u], d_attn, dq, dk_full, dv_full);
      k_full = Tensor();
      v_full = Tensor();
      if (rep) {  // the group's dK/dV: summed over its rounds, sent home by the last
        if (group_first) {
          dk_sum = dk_full;
          dv_sum = dv_full;
        } else {
          be_.add_inplace(dk_full, dk_sum);
          be_.add_inplace(dv_full, dv_sum);
        }
        dk_full = dk_sum;
        dv_full = dv_sum;
        if (group_last) {
          group_k_full = group_v_full = dk_sum = dv_sum = Tensor();
        } else if (r != p_) {
          // This buffer's wk/wv rows go to owner r: zero (after the products that write the
          // rest of it, which deferred run in W).
          after_products([this, stale = kv_replica_rows(dims_, g)]() mutable { be_.fill(0.0, stale); });
        }
      }
      // With overlap, the next unit's K/V start moving now, behind this unit's projections'
      // backward and the next unit's output projection: in the buffers this unit's K/V just
      // left (a KV group's are released by its last unit), so the peak does not grow.
      if (opt_.overlap && needs_gather(static_cast<int>(u) + 1) && !group_k_full.defined())
        next_kv = start_regather(static_cast<int>(u) + 1);
      // dK, dV of every position go home: rank p receives the sum for its own tokens.
      Tensor dk, dv;
      std::vector<CommRequest> rs;
      if (group_last) {
        dk = act({B, Sl, kvh_b_, d});
        dv = act({B, Sl, kvh_b_, d});
        rs = start_reduce_scatter(dk_full, dk);
        std::vector<CommRequest> rsv = start_reduce_scatter(dv_full, dv);
        for (CommRequest& req : rsv) rs.push_back(std::move(req));
        if (!opt_.overlap) wait_all(rs);
      }
      // While dK/dV travel: the query side. The unit's heads' biases and the q/k norms (as the
      // forward attached them) with their gradients through this unit's scratch (ub,
      // unit_norm_grad_), added into this step's replicated partials below: the bias slices
      // are this unit's alone, the norm gains every unit's.
      const int64_t q_head0 = r * dims_.heads + b * heads_b_, kv_head0 = dims_.kv_head0(r) + bucket_kv0(b);
      QkvWeights qw = qkv_view(bw), g_qkv = qkv_view(gw), partial;
      attach_attn_variants(w, l, q_head0, heads_b_, kv_head0, kvh_b_, qw);
      attach_attn_variants(variant_partials_, l, q_head0, heads_b_, kv_head0, kvh_b_, partial);
      if (partial.bq.defined()) {
        g_qkv.bq = ub.q;
        g_qkv.bk = ub.k;
        g_qkv.bv = ub.v;
      }
      const QkvSaved* normed = qw.q_norm.defined() ? &s.normed[u] : nullptr;
      if (normed != nullptr) {
        be_.fill(0.0, unit_norm_grad_);
        g_qkv.q_norm = unit_norm_grad_.narrow(0, 1).reshape({d});
        g_qkv.k_norm = unit_norm_grad_.narrow(1, 2).reshape({d});
      }
      q_backward(ctx_, qw, s.norm.a, dq, d_a1, g_qkv, g_beta, normed);
      poke(next_kv.gather);
      if (group_last) {
        poke(rs);
        wait_all(rs);
        kv_backward(ctx_, qw, s.norm.a, dk, dv, d_a1, g_qkv, g_beta, normed);
      }
      if (normed != nullptr) be_.add_inplace(unit_norm_grad_, variant_partials_.qk_norm[static_cast<size_t>(l)]);
      if (partial.bq.defined()) {
        be_.add_inplace(ub.q, partial.bq);
        if (group_last) {  // the k/v side ran (once per KV group)
          be_.add_inplace(ub.k, partial.bk);
          be_.add_inplace(ub.v, partial.bv);
        }
      }
      if (u == 0 && g_wo.b.defined()) be_.add_inplace(ub.o, variant_partials_.o_bias[static_cast<size_t>(l)]);
    }
    // fwd: broadcast from r; bwd: reduce to r (in place at the owner).
    FP_CHECK(static_cast<size_t>(g.numel()) == shard_elems, "attention partial {} for a shard of {}", g.describe(),
             shard_elems);
    after_products([this, g_req, g, r]() mutable { reduce_home(*g_req, g, r); });
    if (r + 1 < D_) {
      if (!opt_.overlap) start_bcast(r + 1);
      wait(w_req);
    }
  }
  after_products([this, g_req] { wait(*g_req); });
  if (rep) {  // the group's last owner holds the whole wk/wv gradient: copied to the replicas
    after_products([this, rows = kv_replica_rows(dims_, grads.attn[l])]() mutable {
      const auto t0 = StepTimer::Clock::now();
      blocking(copy_kv_replica(comm_, dims_, dims_.kv_group_last(p_), rows), t0);
    });
  }
  // x_mid = x + ...: dx = d_out + norm^T(d_a1); the norm gain's partial stays local until
  // sum_norm_partials().
  return norm_backward(ctx_, w.attn_norm[l], s.norm, d_a1, &d_out, norm_partials_[l]);
}

}  // namespace foldpar::tsp_detail
