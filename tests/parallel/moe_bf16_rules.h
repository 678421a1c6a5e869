// The bf16 rules of the MoE parity tests (tsp_moe_parity_test, megatron_moe_parity_test,
// pipeline_moe_parity_test): the tolerances of a MoE step in bf16 storage against the
// single-rank model in bf16 and in f32, and the weights that keep its routing the references'
// (moe_margin_weights), set into a sharded model slice by slice (load_global). Not collective.
//
// Both sides store weights and activations in bf16 and compute through the bf16 storage
// decorator (f32 arithmetic, every bf16 result rounded once; statistics, the routing sums,
// the aux gradient and the gradients f32), as `train --bf16` runs them. The tolerances are
// megatron_parity_test.cc's, with its derivation: one bf16 rounding moves a value by up to
// 2^-9 relative (one ulp is 2^-8); a step chains about 40 dependent rounded results, so the
// loss (an average over the tokens) stays within 1 ulp and logits and gradients within 16
// ulp. A sparse layer adds the routing weights and the weighted combine to a token's chain,
// within that budget.
//
// Routing is a discontinuous function of the router logits: two runs that round differently
// (the layout sums partial outputs shard by shard) pick different experts for a token whose
// k-th and (k+1)-th logits lie within bf16's noise of each other, and then differ by O(1) in
// that token's row whatever the precision. So the weights (moe_margin_weights) give every
// choice a margin far above that noise in every layer: coordinate 0 of the residual stream is
// 0.5 for every token (embedding column 0) and stays so (row 0 of o_proj and of every down
// projection is zero: nothing writes it), so a_0 = 0.5 g_0 / rms(x) > 0 for every token;
// router column 0 is c_e (per sparse layer one of two orders, so every expert is chosen in
// some layer), the rest of the router a tenth of its initialization. The k-th and (k+1)-th
// logits are then 0.3 a_0 apart against a token-dependent part about ten times smaller, while
// the routing weights and probabilities still differ per token. The per-expert load must
// equal the references' (bf16 and f32 alike).
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "model/llama_weights.h"
#include "parallel/param_ref.h"

namespace foldpar::test {

constexpr double kBf16Ulp = 1.0 / 256;  // 2^-8: the spacing of bf16 values relative to their size
constexpr double kBf16LossTol = 1 * kBf16Ulp;
constexpr double kBf16TensorTol = 16 * kBf16Ulp;
// The routers' gradients take two more cancelling differences than any dense weight's: the
// renormalised top-k weights' derivative d_w_i - sum_j w_j d_w_j and the softmax's
// p_i (g_i - sum_j p_j g_j), each a difference of bf16-rounded terms of similar size, which
// can lose a bit or two relative to the result. Observed up to 6.6e-2 (17 ulp) against f32
// and 4.7e-2 against bf16 (tsp=D); 32 ulp, far below the O(1) of a wrong formula.
constexpr double kBf16RouterTol = 32 * kBf16Ulp;

// f32 weights of `init` with the routing margin described above (up to 4 experts ordered by
// router column 0, repeating beyond).
inline LlamaWeights moe_margin_weights(const LlamaConfig& c, const InitOptions& init) {
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(init, w);
  auto set_column0 = [](Tensor& t, float value) {
    std::vector<float> v = read_host_f32(t);
    for (int64_t r = 0; r < t.dim(0); ++r) v[static_cast<size_t>(r * t.dim(1))] = value;
    write_host_f32(v, t);
  };
  auto zero_row0 = [](Tensor& t) {
    std::vector<float> v = read_host_f32(t);
    std::fill_n(v.begin(), t.dim(1), 0.0f);
    write_host_f32(v, t);
  };
  set_column0(w.embed, 0.5f);
  const float orders[2][4] = {{0.0f, 0.6f, -0.6f, 0.3f}, {0.6f, -0.6f, 0.3f, 0.0f}};
  for (auto& l : w.layers) {
    zero_row0(l.wo);
    if (l.w_down.defined()) zero_row0(l.w_down);
    if (!l.moe.defined()) continue;
    for (ExpertWeights& e : l.moe.experts) zero_row0(e.w_down);
    if (l.moe.shared.w_down.defined()) zero_row0(l.moe.shared.w_down);
    std::vector<float> r = read_host_f32(l.moe.router);
    for (float& x : r) x *= 0.1f;
    const int64_t h = l.moe.router.dim(1);
    for (int64_t e = 0; e < l.moe.router.dim(0); ++e)
      r[static_cast<size_t>(e * h)] = orders[l.moe.sparse_index % 2][e % 4];
    write_host_f32(r, l.moe.router);
  }
  return w;
}

// w in `dtype` (bf16: each value rounded to nearest even, as init_weights in bf16 rounds).
inline LlamaWeights converted_weights(const LlamaConfig& c, LlamaWeights& w, DType dtype) {
  LlamaWeights out = LlamaWeights::allocate(c, dtype, MemCategory::kParameters);
  std::vector<Tensor> src;
  w.for_each([&](const std::string&, Tensor& t) { src.push_back(t); });
  size_t i = 0;
  out.for_each([&](const std::string&, Tensor& t) { write_host_f32(read_host_f32(src[i++]), t); });
  return out;
}

// Every parameter of `params` (a model's parameters(); replicated copies included) set from
// the global weights, slice by slice, rounded to the parameter's dtype.
inline void load_global(const std::vector<ParamRef>& params, LlamaWeights& global) {
  std::vector<std::pair<std::string, Tensor>> all;
  global.for_each([&](const std::string& n, Tensor& t) { all.emplace_back(n, t); });
  for (const ParamRef& p : params) {
    std::vector<float> v = read_host_f32(p.param);
    for (const GlobalSlice& s : p.slices) {
      const Tensor* g = nullptr;
      for (const auto& [n, t] : all)
        if (n == s.tensor) g = &t;
      FP_CHECK(g != nullptr, "no global tensor {}", s.tensor);
      const std::vector<float> gv = read_host_f32(*g);
      const int64_t cols = g->dim(-1);
      for (int64_t r = 0; r < s.rows; ++r)
        for (int64_t col = 0; col < s.cols; ++col)
          v[static_cast<size_t>(s.offset + (s.transposed ? col * s.rows + r : r * s.cols + col))] =
              gv[static_cast<size_t>((s.row0 + r) * cols + s.col0 + col)];
    }
    Tensor param = p.param;
    write_host_f32(v, param);
  }
}

}  // namespace foldpar::test
