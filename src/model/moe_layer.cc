// The MoE layer's forward and backward. Every expert is the gated-MLP sub-block
// (sub_blocks.h) over a row range of the dispatched tokens, so its gradient pairs are the
// dense MLP's; what is new here is the dispatch and combine and their adjoints:
//   dispatched = gather(a, token_rows)          =>  d_a += scatter_add(d_dispatched, token_rows)
//   y += scatter_add(out, token_rows, w_row)    =>  d_out = gather(dy, token_rows) * w_row,
//                                                   d_w_row = <gather(dy, token_rows), out>
//   w_row = gather(weights, slot_rows)          =>  d_weights = scatter_add(d_w_row, slot_rows)
//   logits = a R^T                              =>  d_a += d_logits R, dR += d_logits^T a
#include "model/moe_layer.h"

#include <numeric>

#include "backend/bf16_storage_backend.h"

namespace foldpar {
namespace {

Tensor act(const Shape& shape, const Tensor& like) {
  return Tensor::empty(shape, like.dtype(), MemCategory::kActivations);
}



// Records the layer's counts (`choices`: every expert's top-k choices, before any capacity
// drop) and probability sums (the sums via a ones-row GEMM).
void record_stats(const BlockContext& ctx, const MoeLayerWeights& w, const MoeSaved& s,
                  const std::vector<int64_t>& choices, int64_t dropped, MoeAux& aux) {
  Backend& be = *ctx.backend;
  const int64_t T = ctx.rows(), E = w.router.dim(0);
  FP_CHECK(w.sparse_index >= 0 && w.sparse_index < static_cast<int64_t>(aux.counts.size()),
           "sparse layer {} of {}", w.sparse_index, aux.counts.size());
  // The sums in the statistics dtype (f32 for bf16 probabilities), as TSP's (tsp_moe.cc).
  Tensor ones = act({1, T}, s.probs), sums = Tensor::empty({1, E}, stat_dtype(s.probs.dtype()), MemCategory::kActivations);
  be.fill(1.0, ones);
  be.matmul(ones, false, s.probs, false, sums);
  std::vector<double> host(static_cast<size_t>(E));
  if (sums.dtype() == DType::kF64) {
    be.copy_to_host(sums, std::as_writable_bytes(std::span<double>(host)));
  } else {
    std::vector<float> f(static_cast<size_t>(E));
    be.copy_to_host(sums, std::as_writable_bytes(std::span<float>(f)));
    host.assign(f.begin(), f.end());
  }
  auto& counts = aux.counts[w.sparse_index];
  auto& probs = aux.prob_sums[w.sparse_index];
  counts.assign(static_cast<size_t>(E), 0);
  for (int64_t e = 0; e < E; ++e) counts[e] = choices[static_cast<size_t>(e)];
  probs.assign(host.begin(), host.end());
  aux.rows[w.sparse_index] = T;
  aux.dropped[w.sparse_index] = dropped;
}

void shared_forward(const BlockContext& ctx, const MoeLayerWeights& w, const Tensor& a, Tensor& y, MoeSaved& s,
                    bool keep) {
  Backend& be = *ctx.backend;
  const int64_t T = ctx.rows(), h = a.dim(-1);
  // y += sigmoid(a Wsg^T) * shared(a)
  s.shared_out = act({T, h}, a);
  mlp_forward(ctx, expert_mlp_weights(w.shared), a, s.shared_out, keep ? &s.shared_mlp : nullptr, {}, 0.0f);
  Tensor gate_logit = act({T, 1}, a);
  be.matmul(a, false, w.shared_gate, true, gate_logit);
  s.shared_gate = act({T, 1}, a);
  be.sigmoid_forward(gate_logit, s.shared_gate);
  std::vector<int32_t> identity(static_cast<size_t>(T));
  std::iota(identity.begin(), identity.end(), 0);
  s.identity_rows = moe_upload_i32(be, identity);
  be.scatter_add_rows(s.shared_out, s.identity_rows, &s.shared_gate, y);
}

}  // namespace

MoeAux::MoeAux(int64_t experts_, int64_t sparse_layers)
    : experts(experts_),
      counts(static_cast<size_t>(sparse_layers)),
      prob_sums(static_cast<size_t>(sparse_layers)),
      rows(static_cast<size_t>(sparse_layers), 0),
      dropped(static_cast<size_t>(sparse_layers), 0) {}

namespace {
// Totals over the recorded layers: C_e, P_e and N.
void totals(const MoeAux& a, std::vector<double>& c, std::vector<double>& p, double& n) {
  c.assign(static_cast<size_t>(a.experts), 0.0);
  p.assign(static_cast<size_t>(a.experts), 0.0);
  n = 0;
  for (size_t l = 0; l < a.counts.size(); ++l) {
    if (a.rows[l] == 0) continue;
    n += static_cast<double>(a.rows[l]);
    for (int64_t e = 0; e < a.experts; ++e) {
      c[e] += static_cast<double>(a.counts[l][e]);
      p[e] += a.prob_sums[l][e];
    }
  }
}

// E * sum_e (C_e / N)(P_e / N), and its gradient coef * E * C_e / N^2 on each p.
double aux_of(const std::vector<double>& c, const std::vector<double>& p, double n) {
  if (n == 0) return 0;
  double s = 0;
  for (size_t e = 0; e < c.size(); ++e) s += (c[e] / n) * (p[e] / n);
  return static_cast<double>(c.size()) * s;
}
std::vector<double> aux_grad_of(const std::vector<double>& c, double n, double coef) {
  std::vector<double> g(c.size(), 0.0);
  if (n == 0) return g;
  for (size_t e = 0; e < c.size(); ++e) g[e] = coef * static_cast<double>(c.size()) * c[e] / (n * n);
  return g;
}
// One layer's counts as doubles.
std::vector<double> layer_counts(const MoeAux& a, size_t l) {
  std::vector<double> c(static_cast<size_t>(a.experts), 0.0);
  for (size_t e = 0; e < a.counts[l].size(); ++e) c[e] = static_cast<double>(a.counts[l][e]);
  return c;
}
}  // namespace

double MoeAux::loss(bool per_layer) const {
  if (!per_layer) {
    std::vector<double> c, p;
    double n = 0;
    totals(*this, c, p, n);
    return aux_of(c, p, n);
  }
  double s = 0;
  for (size_t l = 0; l < counts.size(); ++l)
    if (rows[l] > 0) s += aux_of(layer_counts(*this, l), prob_sums[l], static_cast<double>(rows[l]));
  return s;
}

std::vector<std::vector<double>> MoeAux::prob_grad(double coef, bool per_layer) const {
  std::vector<std::vector<double>> g(counts.size());
  if (!per_layer) {
    std::vector<double> c, p;
    double n = 0;
    totals(*this, c, p, n);
    const std::vector<double> row = aux_grad_of(c, n, coef);
    for (auto& r : g) r = row;
    return g;
  }
  for (size_t l = 0; l < counts.size(); ++l)
    g[l] = aux_grad_of(layer_counts(*this, l), static_cast<double>(rows[l]), coef);
  return g;
}

std::vector<int64_t> MoeAux::load() const {
  std::vector<int64_t> out(static_cast<size_t>(experts), 0);
  for (const auto& layer : counts)
    for (size_t e = 0; e < layer.size(); ++e) out[e] += layer[e];
  return out;
}

int64_t MoeAux::dropped_pairs() const {
  int64_t n = 0;
  for (int64_t d : dropped) n += d;
  return n;
}

std::vector<double> MoeAux::pack() const {
  std::vector<double> v;
  v.reserve(static_cast<size_t>(packed_size()));
  for (size_t l = 0; l < counts.size(); ++l) {
    for (int64_t e = 0; e < experts; ++e)
      v.push_back(static_cast<size_t>(e) < counts[l].size() ? static_cast<double>(counts[l][e]) : 0.0);
    for (int64_t e = 0; e < experts; ++e)
      v.push_back(static_cast<size_t>(e) < prob_sums[l].size() ? prob_sums[l][e] : 0.0);
    v.push_back(static_cast<double>(rows[l]));
    v.push_back(static_cast<double>(dropped[l]));
  }
  return v;
}

void MoeAux::unpack(const std::vector<double>& v) {
  FP_CHECK(static_cast<int64_t>(v.size()) == packed_size(),
           "{} packed MoE statistics for {} sparse layers x (2 x {} + 2)", v.size(), counts.size(), experts);
  size_t i = 0;
  for (size_t l = 0; l < counts.size(); ++l) {
    counts[l].assign(static_cast<size_t>(experts), 0);
    prob_sums[l].assign(static_cast<size_t>(experts), 0.0);
    for (int64_t e = 0; e < experts; ++e) counts[l][e] = static_cast<int64_t>(v[i++]);
    for (int64_t e = 0; e < experts; ++e) prob_sums[l][e] = v[i++];
    rows[l] = static_cast<int64_t>(v[i++]);
    dropped[l] = static_cast<int64_t>(v[i++]);
  }
}

std::vector<double> MoeAux::flatten(const std::vector<std::vector<double>>& g) {
  std::vector<double> v;
  for (const auto& row : g) v.insert(v.end(), row.begin(), row.end());
  return v;
}

std::vector<std::vector<double>> MoeAux::unflatten(const std::vector<double>& v) const {
  FP_CHECK(v.size() == counts.size() * static_cast<size_t>(experts), "{} aux gradients for {} sparse layers x {}",
           v.size(), counts.size(), experts);
  std::vector<std::vector<double>> g(counts.size());
  for (size_t l = 0; l < g.size(); ++l)
    g[l].assign(v.begin() + static_cast<std::ptrdiff_t>(l * static_cast<size_t>(experts)),
                v.begin() + static_cast<std::ptrdiff_t>((l + 1) * static_cast<size_t>(experts)));
  return g;
}

void moe_forward(const BlockContext& ctx, const MoeLayerWeights& w, const Tensor& a, Tensor& y, MoeSaved* saved,
                 MoeAux* aux) {
  Backend& be = *ctx.backend;
  const MoeConfig& m = ctx.config->moe;
  const int64_t T = ctx.rows(), h = a.dim(-1), E = m.num_experts, k = m.num_experts_per_tok;
  MoeSaved s;
  // ---- routing: p = softmax(a R^T), top k ----
  Tensor logits = act({T, E}, a);
  be.matmul(a, false, w.router, true, logits);
  s.probs = act({T, E}, a);
  s.weights = act({T, k}, a);
  s.experts = Tensor::empty({T, k}, DType::kI32, MemCategory::kActivations);
  be.moe_route_forward(logits, m.norm_topk_prob, s.probs, s.weights, s.experts);
  logits = Tensor();
  std::vector<int32_t> host_experts(static_cast<size_t>(T * k)), token_rows, slot_rows;
  be.copy_to_host(s.experts, std::as_writable_bytes(std::span<int32_t>(host_experts)));
  const std::vector<int64_t> choices = moe_expert_choices(host_experts, E);
  const int64_t dropped = moe_drop_over_capacity(host_experts, ctx.batch, ctx.seq, k, E, m.expert_capacity(ctx.seq));
  moe_dispatch_order(host_experts, k, E, s.offsets, token_rows, slot_rows);
  const int64_t M = static_cast<int64_t>(token_rows.size());  // T k, less the dropped pairs
  s.token_rows = moe_upload_i32(be, token_rows);
  s.slot_rows = moe_upload_i32(be, slot_rows);
  if (aux != nullptr) record_stats(ctx, w, s, choices, dropped, *aux);
  // ---- dispatch, the experts (one GEMM group each), the weighted combine ----
  s.dispatched = act({M, h}, a);
  be.gather_rows(a, s.token_rows, nullptr, s.dispatched);
  s.row_weights = act({M, 1}, a);
  be.gather_rows(s.weights.reshape({T * k, 1}), s.slot_rows, nullptr, s.row_weights);
  s.expert_out = act({M, h}, a);
  s.expert_mlp.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = s.offsets[e], end = s.offsets[e + 1];
    if (begin == end) continue;
    Tensor out = s.expert_out.narrow(begin, end);
    mlp_forward(moe_group_context(ctx, end - begin), expert_mlp_weights(w.experts[e]), s.dispatched.narrow(begin, end), out,
                saved != nullptr ? &s.expert_mlp[e] : nullptr, {}, 0.0f);
  }
  be.scatter_add_rows(s.expert_out, s.token_rows, &s.row_weights, y);
  if (w.shared_gate.defined()) shared_forward(ctx, w, a, y, s, saved != nullptr);
  if (saved != nullptr) *saved = std::move(s);
}

Tensor moe_combine_backward(Backend& be, const MoeSaved& s, const Tensor& dy, Tensor& d_weights_rows) {
  const int64_t M = s.token_rows.numel(), h = dy.dim(-1);
  Tensor dy_rows = act({M, h}, dy), d_out = act({M, h}, dy), d_row_w = act({M, 1}, dy);
  be.gather_rows(dy, s.token_rows, nullptr, dy_rows);
  be.rows_dot(dy_rows, s.expert_out, d_row_w);
  be.gather_rows(dy, s.token_rows, &s.row_weights, d_out);
  be.scatter_add_rows(d_row_w, s.slot_rows, nullptr, d_weights_rows);
  return d_out;
}

void moe_router_backward(Backend& be, const MoeConfig& m, const MoeLayerWeights& w, const MoeSaved& s, const Tensor& a,
                         const Tensor& d_weights, const std::vector<double>& prob_grad, Tensor& d_a, Tensor& d_router,
                         float beta) {
  const int64_t T = a.dim(0), E = m.num_experts;
  Tensor bias;
  if (!prob_grad.empty()) {
    FP_CHECK(static_cast<int64_t>(prob_grad.size()) == E, "aux gradient of {} experts for E={}", prob_grad.size(), E);
    bias = Tensor::empty({E}, stat_dtype(d_weights.dtype()), MemCategory::kActivations);
    if (bias.dtype() == DType::kF64) {
      be.copy_from_host(std::as_bytes(std::span<const double>(prob_grad)), bias);
    } else {
      std::vector<float> f(prob_grad.begin(), prob_grad.end());
      be.copy_from_host(std::as_bytes(std::span<const float>(f)), bias);
    }
  }
  Tensor d_logits = act({T, E}, d_weights);
  Backend::MoeRouteGrad rg{&s.probs, &s.weights, &s.experts, &d_weights, bias.defined() ? &bias : nullptr,
                           m.norm_topk_prob};
  be.moe_route_backward(rg, d_logits);
  // logits = a Wr^T: d_a += d_logits Wr, dWr = d_logits^T a (+ beta dWr)
  be.matmul(d_logits, false, w.router, false, d_a, 1.0f, 1.0f);
  be.matmul(d_logits, true, a, false, d_router, 1.0f, beta);
}

void moe_shared_backward(const BlockContext& ctx, const MoeLayerWeights& w, const MoeSaved& s, const Tensor& a,
                         const Tensor& dy, Tensor& d_a, Tensor& d_gate, float beta, MlpWeights& d_shared) {
  Backend& be = *ctx.backend;
  const int64_t T = a.dim(0), h = a.dim(-1);
  // y += gate * z: d_z = gate * dy, d_gate = <dy, z>, d_logit = gate (1 - gate) d_gate
  Tensor d_z = act({T, h}, dy), d_g = act({T, 1}, dy), d_logit = act({T, 1}, dy);
  be.gather_rows(dy, s.identity_rows, &s.shared_gate, d_z);
  be.rows_dot(dy, s.shared_out, d_g);
  be.sigmoid_backward(s.shared_gate, d_g, d_logit);
  // logit = a Wsg^T: d_a += d_logit Wsg, dWsg = d_logit^T a (+ beta dWsg)
  be.matmul(d_logit, false, w.shared_gate, false, d_a, 1.0f, 1.0f);
  be.matmul(d_logit, true, a, false, d_gate, 1.0f, beta);
  mlp_backward(ctx, expert_mlp_weights(w.shared), s.shared_mlp, a, d_z, d_a, d_shared, 1.0f);
}

void moe_replicated_backward(const BlockContext& ctx, const MoeLayerWeights& w, const MoeSaved& s, const Tensor& a,
                             const Tensor& dy, const Tensor& d_weights,
                             const std::vector<std::vector<double>>& prob_grads, Tensor& d_a, MoeLayerWeights& g,
                             const std::function<void(Tensor& partial, Tensor& grad)>& sum_into) {
  Backend& be = *ctx.backend;
  const int64_t h = a.dim(-1);
  auto partial = [](const Shape& shape) { return Tensor::empty(shape, DType::kF32, MemCategory::kComm); };
  static const std::vector<double> kNoAux;
  const std::vector<double>& prob_grad =
      prob_grads.empty() ? kNoAux : prob_grads[static_cast<size_t>(w.sparse_index)];
  Tensor d_router = partial({ctx.config->moe.num_experts, h});
  moe_router_backward(be, ctx.config->moe, w, s, a, d_weights, prob_grad, d_a, d_router, 0.0f);
  sum_into(d_router, g.router);
  if (!w.shared_gate.defined()) return;
  const int64_t fs = w.shared.w_gate.dim(0);
  Tensor d_gate = partial({1, h});
  ExpertWeights d_shared{partial({fs, h}), partial({fs, h}), partial({h, fs})};
  for (Tensor* t : {&d_shared.w_gate, &d_shared.w_up, &d_shared.w_down}) be.fill(0.0, *t);
  MlpWeights gs = expert_mlp_weights(d_shared);
  moe_shared_backward(ctx, w, s, a, dy, d_a, d_gate, 0.0f, gs);
  sum_into(d_gate, g.shared_gate);
  sum_into(d_shared.w_gate, g.shared.w_gate);
  sum_into(d_shared.w_up, g.shared.w_up);
  sum_into(d_shared.w_down, g.shared.w_down);
}

void moe_backward(const BlockContext& ctx, const MoeLayerWeights& w, const MoeSaved& s, const Tensor& a,
                  const Tensor& dy, Tensor& d_a, MoeLayerWeights& g, const std::vector<double>& prob_grad) {
  Backend& be = *ctx.backend;
  const MoeConfig& m = ctx.config->moe;
  const int64_t T = ctx.rows(), h = a.dim(-1), E = m.num_experts, k = m.num_experts_per_tok;
  const int64_t M = s.token_rows.numel();  // the dispatched pairs (T k less any dropped)
  if (!d_a.defined()) {
    d_a = act({T, h}, dy);
    be.fill(0.0, d_a);
  }
  Tensor d_weights = act({T, k}, dy);
  be.fill(0.0, d_weights);
  Tensor d_weights_rows = d_weights.reshape({T * k, 1});  // a dropped pair's stays 0
  Tensor d_out = moe_combine_backward(be, s, dy, d_weights_rows);
  // ---- each expert's group, then the dispatch's adjoint ----
  Tensor d_dispatched = act({M, h}, dy);
  be.fill(0.0, d_dispatched);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = s.offsets[e], end = s.offsets[e + 1];
    if (begin == end) continue;
    Tensor d_rows = d_dispatched.narrow(begin, end);
    MlpWeights ge = expert_mlp_weights(g.experts[e]);
    mlp_backward(moe_group_context(ctx, end - begin), expert_mlp_weights(w.experts[e]), s.expert_mlp[e],
                 s.dispatched.narrow(begin, end), d_out.narrow(begin, end), d_rows, ge, 1.0f);
  }
  d_out = Tensor();
  be.scatter_add_rows(d_dispatched, s.token_rows, nullptr, d_a);
  d_dispatched = Tensor();
  moe_router_backward(be, m, w, s, a, d_weights, prob_grad, d_a, g.router, 1.0f);
  if (w.shared_gate.defined()) {
    MlpWeights gs = expert_mlp_weights(g.shared);
    moe_shared_backward(ctx, w, s, a, dy, d_a, g.shared_gate, 1.0f, gs);
  }
}

void moe_dispatch_order(const std::vector<int32_t>& experts, int64_t k, int64_t E, std::vector<int64_t>& offsets,
                        std::vector<int32_t>& token_rows, std::vector<int32_t>& slot_rows) {
  offsets.assign(static_cast<size_t>(E + 1), 0);
  for (int32_t e : experts) {
    if (e == kDroppedExpert) continue;
    FP_CHECK(e >= 0 && e < E, "routing chose expert {} of {}", e, E);
    ++offsets[e + 1];
  }
  std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
  token_rows.resize(static_cast<size_t>(offsets[E]));
  slot_rows.resize(static_cast<size_t>(offsets[E]));
  for (size_t p = 0; p < experts.size(); ++p) {
    if (experts[p] == kDroppedExpert) continue;
    const int64_t at = next[experts[p]]++;
    token_rows[at] = static_cast<int32_t>(p / k);
    slot_rows[at] = static_cast<int32_t>(p);
  }
}

std::vector<int64_t> moe_expert_choices(const std::vector<int32_t>& experts, int64_t E) {
  std::vector<int64_t> choices(static_cast<size_t>(E), 0);
  for (int32_t e : experts)
    if (e >= 0 && e < E) ++choices[static_cast<size_t>(e)];
  return choices;
}

int64_t moe_dropped_count(const std::vector<int32_t>& experts) {
  return static_cast<int64_t>(std::count(experts.begin(), experts.end(), kDroppedExpert));
}

int64_t moe_drop_over_capacity(std::vector<int32_t>& experts, int64_t batch, int64_t seq, int64_t k, int64_t E,
                               int64_t capacity) {
  FP_CHECK(static_cast<int64_t>(experts.size()) == batch * seq * k, "{} expert ids for {} x {} tokens of k={}",
           experts.size(), batch, seq, k);
  if (capacity <= 0) return 0;
  int64_t dropped = 0;
  std::vector<int64_t> taken(static_cast<size_t>(E));
  for (int64_t b = 0; b < batch; ++b) {
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t p = b * seq * k; p < (b + 1) * seq * k; ++p) {
      int32_t& e = experts[static_cast<size_t>(p)];
      if (e < 0 || e >= E) continue;
      if (taken[static_cast<size_t>(e)]++ >= capacity) {
        e = kDroppedExpert;
        ++dropped;
      }
    }
  }
  return dropped;
}

Tensor moe_upload_i32(Backend& be, const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::kI32, MemCategory::kActivations);
  if (!v.empty()) be.copy_from_host(std::as_bytes(std::span<const int32_t>(v)), t);
  return t;
}

BlockContext moe_group_context(const BlockContext& ctx, int64_t rows) {
  BlockContext g = ctx;
  g.batch = 1;
  g.seq = rows;
  return g;
}

MlpWeights expert_mlp_weights(const ExpertWeights& e) {
  return MlpWeights{e.w_gate, e.w_up, LinearView{e.w_down, false}};
}

}  // namespace foldpar
