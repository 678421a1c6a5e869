// The decode step with stationary weights: TP-style projections and MLP around the
// strategy's attention, the vocabulary-parallel embedding and head.
#include "parallel/decode_block.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "backend/rope_table.h"
#include "model/moe_layer.h"

namespace foldpar {
namespace {

Tensor act(const Shape& shape) { return Tensor::empty(shape, DType::kF32, MemCategory::kActivations); }

// y [B, n] += b [n] on every row (the rank-1 product ones b^T).
void add_rows(Backend& be, const Tensor& b, Tensor& y) {
  const int64_t n = b.numel(), rows = y.numel() / n;
  Tensor ones = act({rows, 1});
  be.fill(1.0, ones);
  Tensor y2 = y.reshape({rows, n});
  be.matmul(ones, false, b.reshape({1, n}), false, y2, 1.0f, 1.0f);
}

// x [..., d] = rmsnorm over each d-row * gain [d], in place of x.
void head_norm(Backend& be, const Tensor& gain, double eps, Tensor& x) {
  const int64_t d = gain.numel(), rows = x.numel() / d;
  Tensor in = act({rows, d}), rstd = act({rows});
  be.copy(x.reshape({rows, d}), in);
  Tensor out = x.reshape({rows, d});
  be.rmsnorm_forward(in, gain, eps, out, rstd);
}

// x [B, h] -> x + attention(norm(x)) Wo^T, summed over the axis.
Tensor attention_block(const DecodeContext& ctx, const ShardedWeights& w, int l, const Tensor& x, const Tensor& rope,
                       DecodeAttention& attention) {
  Backend& be = *ctx.backend;
  const ShardDims& dm = *ctx.dims;
  const int64_t B = x.dim(0), h = dm.h;
  const AttnPieces a = attn_pieces(dm, w.attn[l]);
  Tensor rstd = act({B}), a1 = act({B, h});
  be.rmsnorm_forward(x, w.attn_norm[l], ctx.config->rms_norm_eps, a1, rstd);
  // Column-parallel: this rank's heads. As [1, B, n, d] each sequence's row takes its own
  // row of the RoPE table.
  Tensor q = act({1, B, dm.heads, dm.d}), k = act({1, B, dm.kv_heads, dm.d}), v = act({B, dm.kv_heads, dm.d});
  Tensor q2 = q.reshape({B, dm.q_rows}), k2 = k.reshape({B, dm.kv_rows}), v2 = v.reshape({B, dm.kv_rows});
  be.matmul(a1, false, a.wq, true, q2);
  be.matmul(a1, false, a.wk, true, k2);
  be.matmul(a1, false, a.wv, true, v2);
  QkvWeights variants;  // this rank's heads' biases, the q/k norm gains (sharded_weights.h)
  const int r = ctx.comm->rank();
  attach_attn_variants(w, l, r * dm.heads, dm.heads, dm.kv_head0(r), dm.kv_heads, variants);
  if (variants.bq.defined()) {
    add_rows(be, variants.bq, q2);
    add_rows(be, variants.bk, k2);
    add_rows(be, variants.bv, v2);
  }
  if (variants.q_norm.defined()) {  // per-head q/k RMSNorm before RoPE
    head_norm(be, variants.q_norm, ctx.config->rms_norm_eps, q);
    head_norm(be, variants.k_norm, ctx.config->rms_norm_eps, k);
  }
  be.rope_forward(rope, q);
  be.rope_forward(rope, k);
  Tensor attn = act({B, dm.q_rows});
  attention.attend(l, q.reshape({B, dm.heads, dm.d}), k.reshape({B, dm.kv_heads, dm.d}), v, attn);
  // Row-parallel output projection: this rank's part, summed over the axis (g).
  Tensor y = act({B, h});
  be.matmul(attn, false, a.wo_t, false, y);
  ctx.comm->all_reduce(y);
  if (l < static_cast<int>(w.o_bias.size())) add_rows(be, w.o_bias[l], y);  // replicated: once, after the sum
  be.add_inplace(x, y);
  return y;
}

// x_mid [B, h] -> x_mid + MLP(norm(x_mid)), the MLP's columns of this rank summed over the axis.
Tensor mlp_block(const DecodeContext& ctx, const ShardedWeights& w, int l, const Tensor& x_mid) {
  Backend& be = *ctx.backend;
  const ShardDims& dm = *ctx.dims;
  const int64_t B = x_mid.dim(0), h = dm.h;
  const MlpPieces m = mlp_pieces(dm, w.mlp[l]);
  Tensor rstd = act({B}), a2 = act({B, h});
  be.rmsnorm_forward(x_mid, w.mlp_norm[l], ctx.config->rms_norm_eps, a2, rstd);
  Tensor gate = act({B, dm.f_rows}), up = act({B, dm.f_rows}), a = act({B, dm.f_rows});
  be.matmul(a2, false, m.w_gate, true, gate);
  be.matmul(a2, false, m.w_up, true, up);
  MlpWeights biases;  // Llama's mlp_bias: this rank's columns' slices (sharded_weights.h)
  attach_mlp_bias(w, l, ctx.comm->rank() * dm.f_rows, dm.f_rows, biases);
  if (biases.b_gate.defined()) {
    add_rows(be, biases.b_gate, gate);
    add_rows(be, biases.b_up, up);
  }
  be.swiglu_forward(gate, up, a);
  Tensor y = act({B, h});
  be.matmul(a, false, m.w_down_t, false, y);
  ctx.comm->all_reduce(y);  // g
  if (l < static_cast<int>(w.down_bias.size())) add_rows(be, w.down_bias[l], y);  // replicated: once, after the sum
  be.add_inplace(x_mid, y);
  return y;
}

// This rank's dispatched rows of a decode step: the (token, slot) pairs of the B*k choices
// `ids` that picked its own experts [e0, e0 + El), grouped by expert in token order.
struct OwnRows {
  std::vector<int32_t> tokens, slots;
  std::vector<int64_t> offsets{0};  // [El + 1]
};
OwnRows own_rows(const std::vector<int32_t>& ids, int64_t k, int64_t e0, int64_t El) {
  OwnRows o;
  for (int64_t j = 0; j < El; ++j) {
    const int32_t e = static_cast<int32_t>(e0 + j);
    for (size_t p = 0; p < ids.size(); ++p)
      if (ids[p] == e) {
        o.tokens.push_back(static_cast<int32_t>(p / static_cast<size_t>(k)));
        o.slots.push_back(static_cast<int32_t>(p));
      }
    o.offsets.push_back(static_cast<int64_t>(o.tokens.size()));
  }
  return o;
}

// y [B, h] += sigmoid(a2 Wsg^T) * shared(a2): Qwen2-MoE's replicated shared expert.
void shared_expert(Backend& be, const BlockContext& bctx, const MoeLayerWeights& mw, const Tensor& a2, Tensor& y) {
  const int64_t B = a2.dim(0), h = a2.dim(1);
  Tensor z = act({B, h}), logit = act({B, 1}), gate = act({B, 1});
  mlp_forward(bctx, expert_mlp_weights(mw.shared), a2, z, nullptr, {}, 0.0f);
  be.matmul(a2, false, mw.shared_gate, true, logit);
  be.sigmoid_forward(logit, gate);
  std::vector<int32_t> identity(static_cast<size_t>(B));
  std::iota(identity.begin(), identity.end(), 0);
  be.scatter_add_rows(z, moe_upload_i32(be, identity), &gate, y);
}

// x_mid [B, h] -> x_mid + MoE(norm(x_mid)) for a sparse layer (model/moe_layer.h). Every rank
// routes the same B rows with the replicated router (so every rank chooses alike), runs its
// own E/D experts (or its f_e slice of one, D > E) on the rows routed to them and combines
// them with their routing weights; the sum over the axis (g) adds every rank's experts (and
// an expert's slices: the gated MLP is a sum over its f_e columns). The replicated shared expert is added
// once, after the sum. Weights stay put: one all_reduce [B, h], as the dense MLP's.
Tensor moe_block(const DecodeContext& ctx, const ShardedWeights& w, int l, const Tensor& x_mid) {
  Backend& be = *ctx.backend;
  const MoeLayerWeights& mw = w.moe[l];
  const MoeConfig& m = ctx.config->moe;
  const int64_t B = x_mid.dim(0), h = ctx.dims->h, E = m.num_experts, k = m.num_experts_per_tok;
  const int64_t El = ctx.dims->experts;
  Tensor rstd = act({B}), a2 = act({B, h});
  be.rmsnorm_forward(x_mid, w.mlp_norm[l], ctx.config->rms_norm_eps, a2, rstd);
  Tensor logits = act({B, E}), probs = act({B, E}), weights = act({B, k});
  Tensor experts = Tensor::empty({B, k}, DType::kI32, MemCategory::kActivations);
  be.matmul(a2, false, mw.router, true, logits);
  be.moe_route_forward(logits, m.norm_topk_prob, probs, weights, experts);
  std::vector<int32_t> ids(static_cast<size_t>(B * k));
  be.copy_to_host(experts, std::as_writable_bytes(std::span<int32_t>(ids)));
  const OwnRows own = own_rows(ids, k, ctx.dims->expert0(ctx.comm->rank()), El);
  const int64_t R = static_cast<int64_t>(own.tokens.size());
  const BlockContext bctx{ctx.config, &be, 1, B};
  Tensor y = act({B, h});
  be.fill(0.0, y);
  if (R > 0) {
    const Tensor tokens = moe_upload_i32(be, own.tokens), slots = moe_upload_i32(be, own.slots);
    Tensor in = act({R, h}), row_w = act({R, 1}), out = act({R, h});
    be.gather_rows(a2, tokens, nullptr, in);
    be.gather_rows(weights.reshape({B * k, 1}), slots, nullptr, row_w);
    for (int64_t j = 0; j < El; ++j) {
      const int64_t begin = own.offsets[j], end = own.offsets[j + 1];
      if (begin == end) continue;
      Tensor o = out.narrow(begin, end);
      mlp_forward(moe_group_context(bctx, end - begin), expert_mlp_weights(mw.experts[j]), in.narrow(begin, end), o,
                  nullptr, {}, 0.0f);
    }
    be.scatter_add_rows(out, tokens, &row_w, y);
  }
  ctx.comm->all_reduce(y);  // g
  if (mw.shared_gate.defined()) shared_expert(be, bctx, mw, a2, y);
  be.add_inplace(x_mid, y);
  return y;
}

}  // namespace

Tensor decode_embed(const DecodeContext& ctx, const ShardedWeights& w, std::span<const int32_t> ids) {
  const int64_t B = static_cast<int64_t>(ids.size());
  Tensor id_tensor = Tensor::empty({B}, DType::kI32, MemCategory::kActivations);
  ctx.backend->copy_from_host(std::as_bytes(ids), id_tensor);
  Tensor x = act({B, ctx.dims->h});
  embedding_partial(*ctx.backend, ctx.comm->rank(), id_tensor, w.embed, x);
  ctx.comm->all_reduce(x);  // g: every id's row comes from the one rank that holds it
  return x;
}

Tensor decode_layers(const DecodeContext& ctx, const ShardedWeights& w, int64_t first, int64_t end, Tensor x,
                     std::span<const int32_t> positions, DecodeAttention& attention) {
  FP_CHECK(static_cast<int64_t>(positions.size()) == x.dim(0) && !positions.empty(),
           "decode layers of {} rows at {} positions", x.dim(0), positions.size());
  // Dynamic RoPE sees the sequence as long as its newest token (Hugging Face's generate
  // rescales per step too); the cached keys keep the frequencies they were rotated with.
  const int64_t seq_len = *std::max_element(positions.begin(), positions.end()) + 1;
  const Tensor rope = build_rope_table(*ctx.backend, positions, ctx.config->rope_spec(), seq_len, DType::kF32);
  for (int64_t l = first; l < end; ++l) {
    const int layer = static_cast<int>(l);
    x = attention_block(ctx, w, layer, x, rope, attention);
    const bool sparse = static_cast<size_t>(l) < w.moe.size() && w.moe[l].defined();
    x = sparse ? moe_block(ctx, w, layer, x) : mlp_block(ctx, w, layer, x);
  }
  return x;
}

Tensor decode_step(const DecodeContext& ctx, const ShardedWeights& w, std::span<const int32_t> ids,
                   std::span<const int32_t> positions, DecodeAttention& attention) {
  FP_CHECK(positions.size() == ids.size() && !ids.empty(), "decode step of {} ids at {} positions", ids.size(),
           positions.size());
  Tensor x = decode_embed(ctx, w, ids);
  x = decode_layers(ctx, w, 0, static_cast<int64_t>(w.attn.size()), std::move(x), positions, attention);
  return decode_logits(ctx, w, x);
}

void attend_cached(Backend& be, const KvCache& cache, int layer, int64_t b, int32_t position, const Tensor& q,
                   Tensor& out, Tensor& lse) {
  const int64_t n = q.dim(0), d = q.dim(1), heads = cache.kv_heads(), g = n / heads;
  FP_CHECK(q.rank() == 2 && n == g * heads && out.shape() == q.shape() && lse.numel() == n,
           "cached attention of q {} into {} / {} over {} KV heads", q.describe(), out.describe(), lse.describe(), heads);
  if (cache.length(b) == 0) {
    be.fill(0.0, out);
    be.fill(-INFINITY, lse);
    return;
  }
  Tensor q_pos = Tensor::empty({1}, DType::kI32, MemCategory::kActivations);
  be.copy_from_host(std::as_bytes(std::span<const int32_t>(&position, 1)), q_pos);
  const Tensor k_pos = cache.positions(b);
  for (int64_t j = 0; j < heads; ++j) {
    const Tensor qj = q.narrow(j * g, (j + 1) * g).reshape({1, 1, g, d});
    const Tensor k = cache.keys(layer, b, j), v = cache.values(layer, b, j);
    Tensor oj = out.narrow(j * g, (j + 1) * g).reshape({1, 1, g, d});
    Tensor lj = lse.reshape({n}).narrow(j * g, (j + 1) * g).reshape({1, g, 1});
    const AttentionArgs args{&qj, &k, &v, &q_pos, &k_pos, 1.0 / std::sqrt(static_cast<double>(d)), cache.window()};
    be.attention_forward(args, oj, lj);
  }
}

Tensor decode_logits(const DecodeContext& ctx, const ShardedWeights& w, const Tensor& x) {
  Backend& be = *ctx.backend;
  const ShardDims& dm = *ctx.dims;
  const int64_t B = x.dim(0), vr = dm.v_rows, D = dm.degree;
  Tensor rstd = act({B}), xf = act({B, dm.h});
  be.rmsnorm_forward(x, w.final_norm, ctx.config->rms_norm_eps, xf, rstd);
  Tensor local = act({B, vr});
  be.matmul(xf, false, w.lm_head, true, local);
  // Every rank's vocabulary rows, rank-major [D, B, V/D], into [B, V].
  Tensor all = Tensor::empty({D, B, vr}, DType::kF32, MemCategory::kComm);
  const auto t0 = std::chrono::steady_clock::now();
  ctx.comm->blocking(
      ctx.comm->comm().all_gather(local.raw_data(), all.raw_data(), static_cast<size_t>(B * vr), DType::kF32), t0);
  Tensor logits = act({B, vr * D});
  for (int64_t r = 0; r < D; ++r) be.copy_strided(all, logits, {B, vr, {r * B * vr, vr}, {r * vr, vr * D}});
  return logits;
}

Tensor WeightShardedDecoder::finish_decode(Backend& be, TpComm& comm, std::span<const int32_t> tokens,
                                           const std::vector<int32_t>& positions, DecodeAttention& attention,
                                           std::chrono::steady_clock::time_point t0) {
  const DecodeContext ctx{&config_, &dims_, &be, &comm};
  Tensor logits = decode_step(ctx, weights_, tokens, positions, attention);
  for (int64_t& n : lengths_) ++n;
  ++decoded_;
  times_.decode_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  times_.decode_comm_seconds += comm.blocked_seconds();
  return logits;
}

}  // namespace foldpar
