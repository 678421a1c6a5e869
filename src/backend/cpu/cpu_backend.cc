// The fast CPU backend (f32; bf16 operands for matmul where the CPU has bf16 instructions):
// GEMMs on oneDNN, OpenBLAS or the skinny kernel (gemm_engine.h), the blocked flash attention
// kernel, and single-pass vectorizable loops for the token-wise ops. Every op here has a reference
// in reference_backend.cc and a parity test in tests/unit/backend_parity_test.cc.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/bf16_round.h"
#include "backend/cpu/flash_attention.h"
#include "backend/cpu/gemm_engine.h"
#include "backend/cpu/vec_math.h"
#include "backend/cpu/moe_ops.h"
#include "backend/op_checks.h"

namespace foldpar {
namespace {

void check_f32(const Tensor& t, const char* what) {
  FP_CHECK(t.dtype() == DType::kF32, "cpu backend {}: {} is not f32", what, t.describe());
}

// The token-wise ops on f32 or bf16 tensors (Backend::tokenwise_takes_bf16): a run of a
// tensor's elements as f32 (its own memory when f32; widened into a small buffer when bf16,
// so a bf16 element is read once and stays in L1), and writable runs rounded back once.
void check_tokenwise(const Tensor& t, const char* what) {
  FP_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kBF16, "cpu backend {}: {} is not f32 or bf16", what,
           t.describe());
}
void check_tokenwise(std::initializer_list<const Tensor*> ts, const char* what) {
  for (const Tensor* t : ts) check_tokenwise(*t, what);
}
// Elements per run of the flat ops: 4 KiB as f32, so swiglu_backward's five widened runs stay
// in L1 (4096-element runs spilled to L2: its bf16 step took 44 ms against 33 at S = 4096).
constexpr int64_t kTokenwiseRun = 1024;

// n bf16 elements of t from `offset`, widened into buf (resized to n).
float* widen_run(const Tensor& t, int64_t offset, int64_t n, std::vector<float>& buf) {
  buf.resize(static_cast<size_t>(n));
  const bf16* p = t.data<bf16>() + offset;
  for (int64_t i = 0; i < n; ++i) buf[static_cast<size_t>(i)] = bf16_to_f32(p[i]);
  return buf.data();
}

class F32In {
 public:
  explicit F32In(const Tensor& t) : t_(t) {}
  const float* at(int64_t offset, int64_t n) {
    return t_.dtype() == DType::kF32 ? t_.data<float>() + offset : widen_run(t_, offset, n, buf_);
  }

 private:
  const Tensor& t_;
  std::vector<float> buf_;
};

// at() gives the run to write (holding the old values when `load`); commit() stores it.
class F32Out {
 public:
  F32Out(Tensor& t, bool load) : t_(t), load_(load) {}
  float* at(int64_t offset, int64_t n) {
    offset_ = offset;
    n_ = n;
    if (t_.dtype() == DType::kF32) return t_.data<float>() + offset;
    if (load_) return widen_run(t_, offset, n, buf_);
    buf_.resize(static_cast<size_t>(n));
    return buf_.data();
  }
  void commit() {
    if (t_.dtype() == DType::kF32) return;
    round_run_to_bf16(buf_.data(), n_, t_.data<bf16>() + offset_);
  }

 private:
  Tensor& t_;
  bool load_;
  int64_t offset_ = 0, n_ = 0;
  std::vector<float> buf_;
};

// fn(offset, n) over [0, total) in runs of kTokenwiseRun.
template <typename Fn>
void for_runs(int64_t total, Fn&& fn) {
  for (int64_t o = 0; o < total; o += kTokenwiseRun) fn(o, std::min(kTokenwiseRun, total - o));
}

class CpuBackend final : public Backend {
 public:
  std::string_view name() const override { return "cpu"; }

  // f32 products, and bf16 x bf16 ones (f32 accumulation, c bf16 or f32) where the CPU
  // multiplies bf16 natively (matmul_takes_bf16); the engine per shape: gemm_engine.h.
  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    const bool mixed = a.dtype() == DType::kBF16;
    const MatmulDims d = mixed ? check_matmul_bf16(a, ta, b, tb, c) : check_matmul(a, ta, b, tb, c);
    if (!mixed) check_f32(a, "matmul");
    FP_CHECK(!mixed || matmul_takes_bf16(), "cpu backend matmul: bf16 operands on a CPU without bf16 compute ({})",
             gemm_engine_report().onednn_isa);
    if (d.m == 0 || d.n == 0) return;
    if (d.k == 0) {  // a GEMM with k = 0 still scales c by beta
      scale_or_zero(beta, c);
      return;
    }
    if (mixed) {
      gemm_bf16(d, ta, tb, a.data<bf16>(), b.data<bf16>(), c.dtype(), c.raw_data(), alpha, beta);
    } else {
      gemm_f32(GemmEngine::kAuto, d, ta, tb, a.data<float>(), b.data<float>(), c.data<float>(), alpha, beta);
    }
  }
  bool matmul_takes_bf16() const override { return gemm_engine_report().bf16_native; }
  // Any CPU could, but bf16 layouts run here only where matmul takes bf16, and the dry run's
  // meta backend answers the same (MetaBackend: both follow its matmul_takes_bf16).
  bool tokenwise_takes_bf16() const override { return matmul_takes_bf16(); }

  // Same dtype: one memmove. f32 <-> bf16: one pass (widening is a shift; narrowing rounds
  // to nearest even, f32_to_bf16), what the bf16 storage decorator widens and narrows with.
  void copy(const Tensor& src, Tensor& dst) override {
    check_copy(src, dst);
    const int64_t n = src.numel();
    if (src.dtype() == DType::kBF16 && dst.dtype() == DType::kF32) {
      const bf16* s = src.data<bf16>();
      float* d = dst.data<float>();
      for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
    } else if (src.dtype() == DType::kF32 && dst.dtype() == DType::kBF16) {
      const float* s = src.data<float>();
      bf16* d = dst.data<bf16>();
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
    } else {
      dst.copy_from(src.reshape(dst.shape()));
    }
  }
  // One memcpy per row (any dtype).
  void copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) override {
    if (!check_copy_strided(src, dst, c)) return;
    const size_t e = dtype_size(src.dtype()), row = static_cast<size_t>(c.cols) * e;
    const auto* S = static_cast<const std::byte*>(src.raw_data()) + c.src.offset * e;
    auto* D = static_cast<std::byte*>(dst.raw_data()) + c.dst.offset * e;
    for (int64_t i = 0; i < c.rows; ++i) std::memcpy(D + i * c.dst.row_stride * e, S + i * c.src.row_stride * e, row);
  }
  void copy_from_host(std::span<const std::byte> src, Tensor& dst) override {
    check_host_copy(dst, src.size(), "copy_from_host");
    dst.count_host_copy(static_cast<int64_t>(src.size()), 0);
    if (!src.empty()) std::memcpy(dst.raw_data(), src.data(), src.size());
  }
  void copy_to_host(const Tensor& src, std::span<std::byte> dst) override {
    check_host_copy(src, dst.size(), "copy_to_host");
    src.count_host_copy(0, static_cast<int64_t>(dst.size()));
    if (!dst.empty()) std::memcpy(dst.data(), src.raw_data(), dst.size());
  }
  void add_inplace(const Tensor& x, Tensor& y) override {
    check_add_inplace(x, y, tokenwise_takes_bf16());
    check_tokenwise(x, "add_inplace");
    F32In xi(x);
    F32Out yo(y, true);
    for_runs(x.numel(), [&](int64_t o, int64_t n) {
      const float* X = xi.at(o, n);
      float* Y = yo.at(o, n);
      for (int64_t i = 0; i < n; ++i) Y[i] += X[i];
      yo.commit();
    });
  }
  void scale_inplace(double alpha, Tensor& y) override {
    check_f32(y, "scale_inplace");
    float* Y = y.data<float>();
    const float a = static_cast<float>(alpha);
    const int64_t n = y.numel();
    for (int64_t i = 0; i < n; ++i) Y[i] *= a;
  }
  void fill(double value, Tensor& y) override {
    check_f32(y, "fill");
    std::fill_n(y.data<float>(), y.numel(), static_cast<float>(value));
  }
  void adamw_update(const AdamWStep& s, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) override {
    check_f32(param, "adamw_update");
    check_adamw(grad, param, m, v);
    const float c1 = static_cast<float>(1.0 - std::pow(s.beta1, static_cast<double>(s.step)));
    const float c2 = static_cast<float>(1.0 - std::pow(s.beta2, static_cast<double>(s.step)));
    const float b1 = static_cast<float>(s.beta1), b2 = static_cast<float>(s.beta2), eps = static_cast<float>(s.eps);
    const float lr = static_cast<float>(s.lr), wd = static_cast<float>(s.weight_decay);
    const float gs = static_cast<float>(s.grad_scale), inv_c1 = 1.0f / c1, inv_c2 = 1.0f / c2;
    const float* G = grad.data<float>();
    float *P = param.data<float>(), *M = m.data<float>(), *V = v.data<float>();
    const int64_t n = param.numel();
    for (int64_t i = 0; i < n; ++i) {
      const float g = G[i] * gs;
      const float mi = b1 * M[i] + (1 - b1) * g, vi = b2 * V[i] + (1 - b2) * g * g;
      M[i] = mi;
      V[i] = vi;
      P[i] -= lr * (mi * inv_c1 / (std::sqrt(vi * inv_c2) + eps) + wd * P[i]);
    }
  }
  double sum_squares(const Tensor& x) override {
    check_f32(x, "sum_squares");
    const float* X = x.data<float>();
    const int64_t n = x.numel();
    double total = 0;
    // f32 partial sums over short runs, f64 across runs: vectorizes, and the f32 error stays
    // bounded by the run length.
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
      float part = 0;
      for (int64_t i = i0; i < std::min(n, i0 + 256); ++i) part += X[i] * X[i];
      total += part;
    }
    return total;
  }

  void embedding_forward(const Tensor& ids, const Tensor& table, int64_t vocab_offset, Tensor& out) override {
    const int64_t rows = table.dim(0), h = table.dim(1);
    check_embedding_forward(ids, table, out);
    check_f32(table, "embedding");
    const int32_t* I = ids.data<int32_t>();
    const float* W = table.data<float>();
    float* O = out.data<float>();
    for (int64_t t = 0; t < ids.numel(); ++t) {
      const int64_t r = I[t] - vocab_offset;
      if (r >= 0 && r < rows) std::memcpy(O + t * h, W + r * h, static_cast<size_t>(h) * sizeof(float));
    }
  }
  void embedding_backward(const Tensor& ids, const Tensor& d_out, int64_t vocab_offset, Tensor& d_table) override {
    const int64_t rows = d_table.dim(0), h = d_table.dim(1);
    check_embedding_backward(ids, d_out, d_table);
    check_f32(d_out, "embedding_backward");
    const int32_t* I = ids.data<int32_t>();
    const float* G = d_out.data<float>();
    float* DT = d_table.data<float>();
    for (int64_t t = 0; t < ids.numel(); ++t) {
      const int64_t r = I[t] - vocab_offset;
      if (r < 0 || r >= rows) continue;
      for (int64_t i = 0; i < h; ++i) DT[r * h + i] += G[t * h + i];
    }
  }

  void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) override {
    check_rmsnorm_forward(x, w, y, rstd);
    check_tokenwise({&x, &w, &y}, "rmsnorm");
    check_f32(rstd, "rmsnorm rstd");
    const int64_t rows = rows_of(x), h = x.dim(-1);
    F32In xi(x), wi(w);
    F32Out yo(y, false);
    const float* W = wi.at(0, h);
    float* R = rstd.data<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = xi.at(r * h, h);
      float ss = 0;
      for (int64_t i = 0; i < h; ++i) ss += xr[i] * xr[i];
      const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(ss) / h + eps));
      R[r] = inv;
      float* yr = yo.at(r * h, h);
      for (int64_t i = 0; i < h; ++i) yr[i] = xr[i] * inv * W[i];
      yo.commit();
    }
  }
  void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dw) override {
    check_rmsnorm_backward(x, w, rstd, dy, dx, dw);
    check_tokenwise({&x, &w, &dy, &dx, &dw}, "rmsnorm_backward");
    check_f32(rstd, "rmsnorm_backward rstd");
    const int64_t rows = rows_of(x), h = x.dim(-1);
    F32In xi(x), wi(w), dyi(dy);
    F32Out dxo(dx, false), dwo(dw, true);
    const float* W = wi.at(0, h);
    const float* R = rstd.data<float>();
    std::vector<double> dw_acc(static_cast<size_t>(h), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const float *xr = xi.at(r * h, h), *gr = dyi.at(r * h, h);
      const float s = R[r];
      float dot = 0;
      for (int64_t i = 0; i < h; ++i) dot += gr[i] * W[i] * xr[i];
      const float coef = s * s * s * dot / static_cast<float>(h);
      float* dxr = dxo.at(r * h, h);
      for (int64_t i = 0; i < h; ++i) {
        dxr[i] = s * gr[i] * W[i] - coef * xr[i];
        dw_acc[i] += gr[i] * xr[i] * s;
      }
      dxo.commit();
    }
    float* DW = dwo.at(0, h);
    for (int64_t i = 0; i < h; ++i) DW[i] += static_cast<float>(dw_acc[i]);
    dwo.commit();
  }

  void rope_forward(const Tensor& table, Tensor& x) override { rope(table, x, 1.0f); }
  void rope_backward(const Tensor& table, Tensor& dx) override { rope(table, dx, -1.0f); }

  // f32, and bf16 q, k, v (bf16 out, dO, dq, dk, dv; lse f32 or bf16) where the CPU
  // multiplies bf16 natively (matmul_takes_bf16): the bf16 kernel, flash_attention.h.
  void attention_forward(const AttentionArgs& a, Tensor& out, Tensor& lse) override {
    const AttentionDims d = check_attention(a, out, lse);
    if (out.dtype() == DType::kBF16) return attention_forward_bf16(a, d, out, lse);
    check_f32(out, "attention");
    flash_attention_forward(d, a.q->data<float>(), a.k->data<float>(), a.v->data<float>(),
                            a.q_pos->data<int32_t>(), a.k_pos->data<int32_t>(), static_cast<float>(a.scale),
                            out.data<float>(), lse.data<float>());
  }
  void attention_backward(const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& d_out,
                          Tensor& dq, Tensor& dk, Tensor& dv) override {
    const AttentionDims d = check_attention_backward(a, out, lse, d_out, dq, dk, dv);
    if (out.dtype() == DType::kBF16) return attention_backward_bf16(a, d, out, lse, d_out, dq, dk, dv);
    check_f32(out, "attention_backward");
    flash_attention_backward(d, a.q->data<float>(), a.k->data<float>(), a.v->data<float>(), out.data<float>(),
                             lse.data<float>(), d_out.data<float>(), a.q_pos->data<int32_t>(),
                             a.k_pos->data<int32_t>(), static_cast<float>(a.scale), dq.data<float>(),
                             dk.data<float>(), dv.data<float>());
  }

  void check_bf16_attention(const Tensor& lse, std::initializer_list<const Tensor*> bf16s) const {
    FP_CHECK(matmul_takes_bf16(), "cpu backend attention: bf16 operands on a CPU without bf16 compute ({})",
             gemm_engine_report().onednn_isa);
    for (const Tensor* t : bf16s)
      FP_CHECK(t->dtype() == DType::kBF16, "cpu backend bf16 attention: {} is not bf16", t->describe());
    FP_CHECK(lse.dtype() == DType::kF32 || lse.dtype() == DType::kBF16, "cpu backend attention lse {}", lse.describe());
  }
  static FlashBf16Inputs bf16_inputs(const AttentionArgs& a) {
    return {a.q->data<bf16>(), a.k->data<bf16>(), a.v->data<bf16>(), a.q_pos->data<int32_t>(),
            a.k_pos->data<int32_t>()};
  }
  void attention_forward_bf16(const AttentionArgs& a, const AttentionDims& d, Tensor& out, Tensor& lse) {
    check_bf16_attention(lse, {&out});
    const float scale = static_cast<float>(a.scale);
    if (lse.dtype() == DType::kF32) {
      flash_attention_forward_bf16(d, bf16_inputs(a), scale, out.data<bf16>(), lse.data<float>());
    } else {
      flash_attention_forward_bf16(d, bf16_inputs(a), scale, out.data<bf16>(), lse.data<bf16>());
    }
  }
  void attention_backward_bf16(const AttentionArgs& a, const AttentionDims& d, const Tensor& out, const Tensor& lse,
                               const Tensor& d_out, Tensor& dq, Tensor& dk, Tensor& dv) {
    check_bf16_attention(lse, {&out, &d_out, &dq, &dk, &dv});
    const float scale = static_cast<float>(a.scale);
    if (lse.dtype() == DType::kF32) {
      flash_attention_backward_bf16(d, bf16_inputs(a), out.data<bf16>(), lse.data<float>(), d_out.data<bf16>(), scale,
                                    dq.data<bf16>(), dk.data<bf16>(), dv.data<bf16>());
    } else {
      flash_attention_backward_bf16(d, bf16_inputs(a), out.data<bf16>(), lse.data<bf16>(), d_out.data<bf16>(), scale,
                                    dq.data<bf16>(), dk.data<bf16>(), dv.data<bf16>());
    }
  }

  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) override {
    check_swiglu_forward(gate, up, out);
    check_tokenwise({&gate, &up, &out}, "swiglu");
    F32In gi(gate), ui(up);
    F32Out oo(out, false);
    for_runs(gate.numel(), [&](int64_t o, int64_t n) {
      const float *G = gi.at(o, n), *U = ui.at(o, n);
      float* O = oo.at(o, n);
      for (int64_t i = 0; i < n; ++i) O[i] = G[i] * vec::sigmoid(G[i]) * U[i];
      oo.commit();
    });
  }
  void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, Tensor& d_gate,
                       Tensor& d_up) override {
    check_swiglu_backward(gate, up, d_out, d_gate, d_up);
    check_tokenwise({&gate, &up, &d_out, &d_gate, &d_up}, "swiglu_backward");
    F32In gi(gate), ui(up), doi(d_out);
    F32Out dgo(d_gate, false), duo(d_up, false);
    for_runs(gate.numel(), [&](int64_t o, int64_t n) {
      const float *G = gi.at(o, n), *U = ui.at(o, n), *DO = doi.at(o, n);
      float *DG = dgo.at(o, n), *DU = duo.at(o, n);
      for (int64_t i = 0; i < n; ++i) {
        const float g = G[i], sig = vec::sigmoid(g), d_o = DO[i];
        const float u = U[i];
        DU[i] = d_o * g * sig;
        DG[i] = d_o * u * sig * (1.0f + g * (1.0f - sig));
      }
      dgo.commit();
      duo.commit();
    });
  }

  double cross_entropy_forward(const Tensor& logits, const Tensor& targets, int32_t ignore_index,
                               Tensor& lse) override {
    check_f32(logits, "cross_entropy");
    const int64_t rows = check_cross_entropy_forward(logits, targets, lse), V = logits.dim(-1);
    check_f32(lse, "cross_entropy lse");
    const float* X = logits.data<float>();
    const int32_t* tg = targets.data<int32_t>();
    float* L = lse.data<float>();
    double loss = 0;
    for (int64_t r = 0; r < rows; ++r) {
      if (tg[r] == ignore_index) {
        L[r] = 0;
        continue;
      }
      FP_CHECK(tg[r] >= 0 && tg[r] < V, "target {} outside vocabulary [0, {})", tg[r], V);
      const float* xr = X + r * V;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < V; ++j) mx = std::max(mx, xr[j]);
      float sum = 0;
      for (int64_t j = 0; j < V; ++j) sum += vec::exp(xr[j] - mx);
      const float l = mx + std::log(sum);
      L[r] = l;
      loss += static_cast<double>(l) - xr[tg[r]];
    }
    return loss;
  }
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t vocab_offset,
                              int32_t ignore_index, double grad_scale, Tensor& d_logits) override {
    check_f32(logits, "cross_entropy_backward");
    const int64_t rows = check_cross_entropy_backward(logits, targets, d_logits), V = logits.dim(-1);
    const float *X = logits.data<float>(), *L = lse.data<float>();
    const int32_t* tg = targets.data<int32_t>();
    float* DX = d_logits.data<float>();
    const float gs = static_cast<float>(grad_scale);
    for (int64_t r = 0; r < rows; ++r) {
      float* dr = DX + r * V;
      if (tg[r] == ignore_index) {
        std::fill_n(dr, V, 0.0f);
        continue;
      }
      const float* xr = X + r * V;
      const float l = L[r];
      for (int64_t j = 0; j < V; ++j) dr[j] = vec::exp(xr[j] - l) * gs;
      const int64_t t = tg[r] - vocab_offset;
      if (t >= 0 && t < V) dr[t] -= gs;
    }
  }

  // f32 throughout, the merge weights in f64 (as the reference).
  void attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) override {
    const AttentionMergeDims d = check_attention_merge(block_out, block_lse, out, lse);
    check_f32(out, "attention_merge");
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    float *o = out.data<float>(), *l = lse.data<float>();
    const float *bo = block_out.data<float>(), *bl = block_lse.data<float>();
    for (int64_t b = 0; b < d.batch; ++b)
      for (int64_t h = 0; h < d.n_h; ++h)
        for (int64_t i = 0; i < d.sq; ++i) {
          const int64_t li = (b * d.n_h + h) * d.sq + i, oi = ((b * d.sq + i) * d.n_h + h) * d.d;
          const float a = l[li], c = bl[li];
          if (c == kNegInf) continue;  // the block shows this query nothing
          if (a == kNegInf) {          // nothing seen before: take the block's result
            std::copy_n(bo + oi, d.d, o + oi);
            l[li] = c;
            continue;
          }
          // Shifted by the larger lse, so neither exponential overflows.
          const double m = std::max(a, c), ea = std::exp(a - m), ec = std::exp(c - m), s = ea + ec;
          const float wa = static_cast<float>(ea / s), wc = static_cast<float>(ec / s);
          for (int64_t e = 0; e < d.d; ++e) o[oi + e] = wa * o[oi + e] + wc * bo[oi + e];
          l[li] = static_cast<float>(m + std::log(s));
        }
  }
  void softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) override {
    const int64_t n = check_softmax_rescale(local_max, global_max, row_sum);
    check_f32(row_sum, "softmax_rescale");
    const float *lm = local_max.data<float>(), *gm = global_max.data<float>();
    float* rs = row_sum.data<float>();
    for (int64_t i = 0; i < n; ++i) rs[i] *= std::exp(lm[i] - gm[i]);
  }
  LossSums cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                const Tensor& targets, int32_t ignore_index, Tensor& lse) override {
    const int64_t n = check_cross_entropy_finish(row_max, row_sum, target_logit, targets, lse);
    check_f32(lse, "cross_entropy_finish");
    const float *m = row_max.data<float>(), *s = row_sum.data<float>(), *tl = target_logit.data<float>();
    const int32_t* tg = targets.data<int32_t>();
    float* l = lse.data<float>();
    LossSums sums;
    for (int64_t i = 0; i < n; ++i) {
      l[i] = m[i] + std::log(s[i]);
      if (tg[i] == ignore_index) continue;
      sums.loss_sum += static_cast<double>(l[i]) - static_cast<double>(tl[i]);
      ++sums.valid_tokens;
    }
    return sums;
  }
  // The MoE ops: backend/cpu/moe_ops.h.
  void moe_route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights,
                         Tensor& experts) override {
    moe_cpu::route_forward(logits, normalize, probs, weights, experts);
  }
  void moe_route_backward(const MoeRouteGrad& g, Tensor& d_logits) override { moe_cpu::route_backward(g, d_logits); }
  void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override {
    moe_cpu::gather_rows(src, rows, scale, dst);
  }
  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override {
    moe_cpu::scatter_add_rows(src, rows, scale, dst);
  }
  void rows_dot(const Tensor& a, const Tensor& b, Tensor& out) override { moe_cpu::rows_dot(a, b, out); }
  void sigmoid_forward(const Tensor& x, Tensor& y) override { moe_cpu::sigmoid_forward(x, y); }
  void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    moe_cpu::sigmoid_backward(y, dy, dx);
  }

  int64_t count_valid_targets(const Tensor& targets, int32_t ignore_index) override {
    check_targets(targets);
    const int32_t* t = targets.data<int32_t>();
    int64_t n = 0;
    for (int64_t i = 0; i < targets.numel(); ++i) n += (t[i] != ignore_index);
    return n;
  }

  void softmax_chunk_update(const Tensor& logits, const Tensor& targets, int64_t vocab_offset, int32_t ignore_index,
                            Tensor& row_max, Tensor& row_sum, Tensor& target_logit) override {
    check_f32(logits, "softmax_chunk_update");
    const int64_t rows = check_softmax_chunk_update(logits, targets, row_max, row_sum, target_logit), V = logits.dim(-1);
    const float* X = logits.data<float>();
    const int32_t* tg = targets.data<int32_t>();
    float *M = row_max.data<float>(), *Ssum = row_sum.data<float>(), *TL = target_logit.data<float>();
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = X + r * V;
      float cm = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < V; ++j) cm = std::max(cm, xr[j]);
      const float m_old = M[r], m_new = std::max(m_old, cm);
      float s = 0;
      for (int64_t j = 0; j < V; ++j) s += vec::exp(xr[j] - m_new);
      // vec::exp(-inf) is exactly 0, so the first shard needs no special case.
      Ssum[r] = Ssum[r] * vec::exp(m_old - m_new) + s;
      M[r] = m_new;
      const int64_t t = tg[r] - vocab_offset;
      if (tg[r] != ignore_index && t >= 0 && t < V) TL[r] = xr[t];
    }
  }

 private:
  static void scale_or_zero(float beta, Tensor& c) {
    if (c.dtype() == DType::kBF16) {
      bf16* C = c.data<bf16>();
      for (int64_t i = 0; i < c.numel(); ++i) C[i] = f32_to_bf16(beta == 0 ? 0.0f : beta * bf16_to_f32(C[i]));
      return;
    }
    float* C = c.data<float>();
    for (int64_t i = 0; i < c.numel(); ++i) C[i] = beta == 0 ? 0.0f : beta * C[i];
  }

  static void rope(const Tensor& table, Tensor& x, float sign) {
    check_tokenwise(x, "rope");
    check_rope(table, x);
    check_f32(table, "rope table");
    const int64_t B = x.dim(0), S = x.dim(1), n = x.dim(2), d = x.dim(3), half = d / 2;
    const float* tab = table.data<float>();
    F32Out xo(x, true);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        const float* cos_row = tab + s * 2 * half;
        const float* sin_row = cos_row + half;
        float* X = xo.at((b * S + s) * n * d, n * d);
        for (int64_t hh = 0; hh < n; ++hh) {
          float* row = X + hh * d;
          for (int64_t i = 0; i < half; ++i) {
            const float c = cos_row[i], sn = sign * sin_row[i];
            const float x1 = row[i], x2 = row[i + half];
            row[i] = x1 * c - x2 * sn;
            row[i + half] = x2 * c + x1 * sn;
          }
        }
        xo.commit();
      }
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

void set_cpu_backend_threads(int threads) { set_gemm_threads(threads); }

}  // namespace foldpar
