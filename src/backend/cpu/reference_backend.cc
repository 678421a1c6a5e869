// The reference backend: the plainest correct loop for every op, accumulating in f64, for
// f32 and f64 tensors. Everything fast is tested against it; finite differences run on its
// f64 instantiation. Speed is irrelevant here; attention still keeps O(Sk) memory per query.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/moe_ops.h"
#include "backend/cpu/dispatch_float.h"
#include "backend/op_checks.h"

namespace foldpar {
namespace {

template <typename T>
void ref_matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, double alpha, double beta) {
  const MatmulDims d = check_matmul(a, ta, b, tb, c);
  const T* A = a.data<T>();
  const T* B = b.data<T>();
  T* C = c.data<T>();
  auto a_at = [&](int64_t i, int64_t p) -> double { return ta ? A[p * d.lda + i] : A[i * d.lda + p]; };
  std::vector<double> acc(static_cast<size_t>(d.n));
  for (int64_t i = 0; i < d.m; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0);
    if (tb) {  // rows of b are contiguous along k: dot products
      for (int64_t j = 0; j < d.n; ++j)
        for (int64_t p = 0; p < d.k; ++p) acc[j] += a_at(i, p) * B[j * d.ldb + p];
    } else {   // rows of b are contiguous along n: one axpy per k
      for (int64_t p = 0; p < d.k; ++p) {
        const double av = a_at(i, p);
        for (int64_t j = 0; j < d.n; ++j) acc[j] += av * B[p * d.ldb + j];
      }
    }
    for (int64_t j = 0; j < d.n; ++j) {
      const double old = beta == 0 ? 0.0 : beta * static_cast<double>(C[i * d.n + j]);
      C[i * d.n + j] = static_cast<T>(alpha * acc[j] + old);
    }
  }
}

template <typename T>
void ref_rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  const int64_t rows = rows_of(x), h = x.dim(-1);
  const T *X = x.data<T>(), *W = w.data<T>();
  T *Y = y.data<T>(), *R = rstd.data<T>();
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < h; ++i) ss += static_cast<double>(X[r * h + i]) * X[r * h + i];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(h) + eps);
    R[r] = static_cast<T>(inv);
    for (int64_t i = 0; i < h; ++i) Y[r * h + i] = static_cast<T>(X[r * h + i] * inv * W[i]);
  }
}

template <typename T>
void ref_rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                          Tensor& dw) {
  const int64_t rows = rows_of(x), h = x.dim(-1);
  const T *X = x.data<T>(), *W = w.data<T>(), *R = rstd.data<T>(), *DY = dy.data<T>();
  T *DX = dx.data<T>(), *DW = dw.data<T>();
  std::vector<double> dw_acc(h, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    // y_i = x_i * s * w_i with s = rstd; dx_i = s * (g_i - x_i * s^2 * mean(g . x)), g = dy . w.
    const double s = R[r];
    double dot = 0;
    for (int64_t i = 0; i < h; ++i) dot += static_cast<double>(DY[r * h + i]) * W[i] * X[r * h + i];
    const double coef = s * s * s * dot / static_cast<double>(h);
    for (int64_t i = 0; i < h; ++i) {
      const double g = static_cast<double>(DY[r * h + i]) * W[i];
      DX[r * h + i] = static_cast<T>(s * g - coef * X[r * h + i]);
      dw_acc[i] += static_cast<double>(DY[r * h + i]) * X[r * h + i] * s;
    }
  }
  for (int64_t i = 0; i < h; ++i) DW[i] = static_cast<T>(DW[i] + dw_acc[i]);
}

// sign = +1 rotates forward, -1 applies the transpose (backward).
template <typename T>
void ref_rope(const Tensor& table, Tensor& x, double sign) {
  check_rope(table, x);
  FP_CHECK(table.dtype() == x.dtype(), "rope: x {} table {}", x.describe(), table.describe());
  const int64_t B = x.dim(0), S = x.dim(1), n = x.dim(2), d = x.dim(3), half = d / 2;
  const T* tab = table.data<T>();
  T* X = x.data<T>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t hh = 0; hh < n; ++hh) {
        T* row = X + ((b * S + s) * n + hh) * d;
        for (int64_t i = 0; i < half; ++i) {
          const double c = tab[(s * 2) * half + i], sn = sign * tab[(s * 2 + 1) * half + i];
          const double x1 = row[i], x2 = row[i + half];
          row[i] = static_cast<T>(x1 * c - x2 * sn);
          row[i + half] = static_cast<T>(x2 * c + x1 * sn);
        }
      }
}

// Scores of query row `qi` (head hq) against every key, scaled; -inf where not visible
// (a later position, or one at least the sliding window behind).
template <typename T>
void ref_scores(const AttentionArgs& a, const AttentionDims& d, int64_t b, int64_t qi, int64_t hq,
                std::vector<double>& s) {
  const T *Q = a.q->data<T>(), *K = a.k->data<T>();
  const int32_t *qp = a.q_pos->data<int32_t>(), *kp = a.k_pos->data<int32_t>();
  const int64_t hk = hq / d.group();
  const T* qrow = Q + ((b * d.sq + qi) * d.n_h + hq) * d.d;
  for (int64_t j = 0; j < d.sk; ++j) {
    const int64_t behind = int64_t{qp[qi]} - kp[j];  // how far the key lies behind the query
    if (behind < 0 || (a.window > 0 && behind >= a.window)) {
      s[j] = -std::numeric_limits<double>::infinity();
      continue;
    }
    const T* krow = K + ((b * d.sk + j) * d.n_kv + hk) * d.d;
    double dot = 0;
    for (int64_t e = 0; e < d.d; ++e) dot += static_cast<double>(qrow[e]) * krow[e];
    s[j] = dot * a.scale;
  }
}

template <typename T>
void ref_attention_forward(const AttentionArgs& a, Tensor& out, Tensor& lse) {
  const AttentionDims d = check_attention(a, out, lse);
  const T* V = a.v->data<T>();
  T *O = out.data<T>(), *L = lse.data<T>();
  std::vector<double> s(d.sk), acc(d.d);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t hq = 0; hq < d.n_h; ++hq)
      for (int64_t qi = 0; qi < d.sq; ++qi) {
        ref_scores<T>(a, d, b, qi, hq, s);
        double mx = -std::numeric_limits<double>::infinity();
        for (double x : s) mx = std::max(mx, x);
        T* orow = O + ((b * d.sq + qi) * d.n_h + hq) * d.d;
        if (mx == -std::numeric_limits<double>::infinity()) {
          for (int64_t e = 0; e < d.d; ++e) orow[e] = 0;
          L[(b * d.n_h + hq) * d.sq + qi] = static_cast<T>(mx);
          continue;
        }
        double sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        const int64_t hk = hq / d.group();
        for (int64_t j = 0; j < d.sk; ++j) {
          if (s[j] == -std::numeric_limits<double>::infinity()) continue;
          const double p = std::exp(s[j] - mx);
          sum += p;
          const T* vrow = V + ((b * d.sk + j) * d.n_kv + hk) * d.d;
          for (int64_t e = 0; e < d.d; ++e) acc[e] += p * vrow[e];
        }
        for (int64_t e = 0; e < d.d; ++e) orow[e] = static_cast<T>(acc[e] / sum);
        L[(b * d.n_h + hq) * d.sq + qi] = static_cast<T>(mx + std::log(sum));
      }
}

template <typename T>
void ref_attention_backward(const AttentionArgs& a, const Tensor& out, const Tensor& lse, const Tensor& d_out,
                            Tensor& dq, Tensor& dk, Tensor& dv) {
  const AttentionDims d = check_attention_backward(a, out, lse, d_out, dq, dk, dv);
  const T *K = a.k->data<T>(), *V = a.v->data<T>(), *O = out.data<T>(), *L = lse.data<T>(),
          *DO = d_out.data<T>();
  // dk, dv accumulate over query rows and GQA groups: sum in f64 buffers.
  std::vector<double> dk_acc(dk.numel(), 0.0), dv_acc(dv.numel(), 0.0), s(d.sk), dq_acc(d.d);
  T* DQ = dq.data<T>();
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t hq = 0; hq < d.n_h; ++hq) {
      const int64_t hk = hq / d.group();
      for (int64_t qi = 0; qi < d.sq; ++qi) {
        const int64_t row = (b * d.sq + qi) * d.n_h + hq;
        const double l = L[(b * d.n_h + hq) * d.sq + qi];
        std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
        if (l == -std::numeric_limits<double>::infinity()) {
          for (int64_t e = 0; e < d.d; ++e) DQ[row * d.d + e] = 0;
          continue;
        }
        ref_scores<T>(a, d, b, qi, hq, s);
        // D = sum_e dO_e * O_e = sum_j P_j dP_j.
        double delta = 0;
        for (int64_t e = 0; e < d.d; ++e) delta += static_cast<double>(DO[row * d.d + e]) * O[row * d.d + e];
        const T* qrow = a.q->data<T>() + row * d.d;
        for (int64_t j = 0; j < d.sk; ++j) {
          if (s[j] == -std::numeric_limits<double>::infinity()) continue;
          const double p = std::exp(s[j] - l);
          const int64_t kv_row = (b * d.sk + j) * d.n_kv + hk;
          double dp = 0;
          for (int64_t e = 0; e < d.d; ++e) {
            dp += static_cast<double>(DO[row * d.d + e]) * V[kv_row * d.d + e];
            dv_acc[kv_row * d.d + e] += p * DO[row * d.d + e];
          }
          const double ds = p * (dp - delta) * a.scale;
          for (int64_t e = 0; e < d.d; ++e) {
            dq_acc[e] += ds * K[kv_row * d.d + e];
            dk_acc[kv_row * d.d + e] += ds * qrow[e];
          }
        }
        for (int64_t e = 0; e < d.d; ++e) DQ[row * d.d + e] = static_cast<T>(dq_acc[e]);
      }
    }
  T *DK = dk.data<T>(), *DV = dv.data<T>();
  for (int64_t i = 0; i < dk.numel(); ++i) {
    DK[i] = static_cast<T>(dk_acc[i]);
    DV[i] = static_cast<T>(dv_acc[i]);
  }
}

template <typename T>
double ref_silu(double g) {
  return g / (1.0 + std::exp(-g));
}

class ReferenceBackend final : public Backend {
 public:
  std::string_view name() const override { return "reference"; }

  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    dispatch_float(a, [&]<typename T>() { ref_matmul<T>(a, ta, b, tb, c, alpha, beta); });
  }

  // f32 <-> bf16 element by element through float (exact widening; f32_to_bf16 rounds).
  void copy(const Tensor& src, Tensor& dst) override {
    check_copy(src, dst);
    if (src.dtype() == dst.dtype()) return dst.copy_from(src.reshape(dst.shape()));
    if (src.dtype() == DType::kBF16) {
      const bf16* s = src.data<bf16>();
      float* d = dst.data<float>();
      for (int64_t i = 0; i < src.numel(); ++i) d[i] = bf16_to_f32(s[i]);
    } else {
      const float* s = src.data<float>();
      bf16* d = dst.data<bf16>();
      for (int64_t i = 0; i < src.numel(); ++i) d[i] = f32_to_bf16(s[i]);
    }
  }
  void copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) override {
    if (!check_copy_strided(src, dst, c)) return;
    const size_t e = dtype_size(src.dtype());
    const auto* S = static_cast<const std::byte*>(src.raw_data());
    auto* D = static_cast<std::byte*>(dst.raw_data());
    for (int64_t i = 0; i < c.rows; ++i)
      for (int64_t j = 0; j < c.cols; ++j)
        std::memcpy(D + (c.dst.offset + i * c.dst.row_stride + j) * e, S + (c.src.offset + i * c.src.row_stride + j) * e,
                    e);
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
    check_add_inplace(x, y);
    dispatch_float(x, [&]<typename T>() {
      const T* X = x.data<T>();
      T* Y = y.data<T>();
      for (int64_t i = 0; i < x.numel(); ++i) Y[i] = static_cast<T>(static_cast<double>(Y[i]) + X[i]);
    });
  }
  void scale_inplace(double alpha, Tensor& y) override {
    dispatch_float(y, [&]<typename T>() {
      T* Y = y.data<T>();
      for (int64_t i = 0; i < y.numel(); ++i) Y[i] = static_cast<T>(alpha * Y[i]);
    });
  }
  void fill(double value, Tensor& y) override {
    dispatch_float(y, [&]<typename T>() {
      T* Y = y.data<T>();
      for (int64_t i = 0; i < y.numel(); ++i) Y[i] = static_cast<T>(value);
    });
  }
  void adamw_update(const AdamWStep& s, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) override {
    check_adamw(grad, param, m, v);
    const double c1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
    const double c2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
    dispatch_float(param, [&]<typename T>() {
      const T* G = grad.data<T>();
      T *P = param.data<T>(), *M = m.data<T>(), *V = v.data<T>();
      for (int64_t i = 0; i < param.numel(); ++i) {
        const double g = static_cast<double>(G[i]) * s.grad_scale;
        const double mi = s.beta1 * M[i] + (1 - s.beta1) * g, vi = s.beta2 * V[i] + (1 - s.beta2) * g * g;
        M[i] = static_cast<T>(mi);
        V[i] = static_cast<T>(vi);
        const double update = (mi / c1) / (std::sqrt(vi / c2) + s.eps) + s.weight_decay * static_cast<double>(P[i]);
        P[i] = static_cast<T>(P[i] - s.lr * update);
      }
    });
  }
  double sum_squares(const Tensor& x) override {
    double s = 0;
    dispatch_float(x, [&]<typename T>() {
      const T* X = x.data<T>();
      for (int64_t i = 0; i < x.numel(); ++i) s += static_cast<double>(X[i]) * X[i];
    });
    return s;
  }

  void embedding_forward(const Tensor& ids, const Tensor& table, int64_t vocab_offset, Tensor& out) override {
    const int64_t rows = table.dim(0), h = table.dim(1);
    check_embedding_forward(ids, table, out);
    const int32_t* I = ids.data<int32_t>();
    const auto* src = static_cast<const char*>(table.raw_data());
    auto* dst = static_cast<char*>(out.raw_data());
    const size_t row_bytes = static_cast<size_t>(h) * dtype_size(table.dtype());
    for (int64_t t = 0; t < ids.numel(); ++t) {
      const int64_t r = I[t] - vocab_offset;
      if (r >= 0 && r < rows) std::memcpy(dst + t * row_bytes, src + r * row_bytes, row_bytes);
    }
  }
  void embedding_backward(const Tensor& ids, const Tensor& d_out, int64_t vocab_offset, Tensor& d_table) override {
    const int64_t rows = d_table.dim(0), h = d_table.dim(1);
    check_embedding_backward(ids, d_out, d_table);
    dispatch_float(d_out, [&]<typename T>() {
      const int32_t* I = ids.data<int32_t>();
      const T* G = d_out.data<T>();
      T* DT = d_table.data<T>();
      // Sum each table row's contributions in f64, then add once.
      std::vector<double> acc(static_cast<size_t>(rows * h), 0.0);
      for (int64_t t = 0; t < ids.numel(); ++t) {
        const int64_t r = I[t] - vocab_offset;
        if (r < 0 || r >= rows) continue;
        for (int64_t i = 0; i < h; ++i) acc[r * h + i] += G[t * h + i];
      }
      for (int64_t i = 0; i < rows * h; ++i) DT[i] = static_cast<T>(DT[i] + acc[i]);
    });
  }

  void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) override {
    check_rmsnorm_forward(x, w, y, rstd);
    dispatch_float(x, [&]<typename T>() { ref_rmsnorm_forward<T>(x, w, eps, y, rstd); });
  }
  void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor& dw) override {
    check_rmsnorm_backward(x, w, rstd, dy, dx, dw);
    dispatch_float(x, [&]<typename T>() { ref_rmsnorm_backward<T>(x, w, rstd, dy, dx, dw); });
  }

  void rope_forward(const Tensor& table, Tensor& x) override {
    dispatch_float(x, [&]<typename T>() { ref_rope<T>(table, x, +1.0); });
  }
  void rope_backward(const Tensor& table, Tensor& dx) override {
    dispatch_float(dx, [&]<typename T>() { ref_rope<T>(table, dx, -1.0); });
  }

  void attention_forward(const AttentionArgs& args, Tensor& out, Tensor& lse) override {
    dispatch_float(out, [&]<typename T>() { ref_attention_forward<T>(args, out, lse); });
  }
  void attention_backward(const AttentionArgs& args, const Tensor& out, const Tensor& lse, const Tensor& d_out,
                          Tensor& dq, Tensor& dk, Tensor& dv) override {
    dispatch_float(out, [&]<typename T>() { ref_attention_backward<T>(args, out, lse, d_out, dq, dk, dv); });
  }

  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) override {
    check_swiglu_forward(gate, up, out);
    dispatch_float(gate, [&]<typename T>() {
      const T *G = gate.data<T>(), *U = up.data<T>();
      T* O = out.data<T>();
      for (int64_t i = 0; i < gate.numel(); ++i) O[i] = static_cast<T>(ref_silu<T>(G[i]) * U[i]);
    });
  }
  void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, Tensor& d_gate,
                       Tensor& d_up) override {
    check_swiglu_backward(gate, up, d_out, d_gate, d_up);
    dispatch_float(gate, [&]<typename T>() {
      const T *G = gate.data<T>(), *U = up.data<T>(), *DO = d_out.data<T>();
      T *DG = d_gate.data<T>(), *DU = d_up.data<T>();
      for (int64_t i = 0; i < gate.numel(); ++i) {
        const double g = G[i], sig = 1.0 / (1.0 + std::exp(-g));
        const double dsilu = sig * (1.0 + g * (1.0 - sig));
        const double d_o = DO[i], u = U[i];
        DU[i] = static_cast<T>(d_o * g * sig);
        DG[i] = static_cast<T>(d_o * u * dsilu);
      }
    });
  }

  double cross_entropy_forward(const Tensor& logits, const Tensor& targets, int32_t ignore_index,
                               Tensor& lse) override {
    const int64_t rows = check_cross_entropy_forward(logits, targets, lse), V = logits.dim(-1);
    FP_CHECK(lse.dtype() == logits.dtype(), "cross_entropy lse {}", lse.describe());
    double loss = 0;
    dispatch_float(logits, [&]<typename T>() {
      const T* X = logits.data<T>();
      const int32_t* tg = targets.data<int32_t>();
      T* L = lse.data<T>();
      for (int64_t r = 0; r < rows; ++r) {
        if (tg[r] == ignore_index) {
          L[r] = 0;
          continue;
        }
        FP_CHECK(tg[r] >= 0 && tg[r] < V, "target {} outside vocabulary [0, {})", tg[r], V);
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < V; ++j) mx = std::max(mx, static_cast<double>(X[r * V + j]));
        double sum = 0;
        for (int64_t j = 0; j < V; ++j) sum += std::exp(X[r * V + j] - mx);
        const double l = mx + std::log(sum);
        L[r] = static_cast<T>(l);
        loss += l - X[r * V + tg[r]];
      }
    });
    return loss;
  }
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t vocab_offset,
                              int32_t ignore_index, double grad_scale, Tensor& d_logits) override {
    const int64_t rows = check_cross_entropy_backward(logits, targets, d_logits), V = logits.dim(-1);
    dispatch_float(logits, [&]<typename T>() {
      const T *X = logits.data<T>(), *L = lse.data<T>();
      const int32_t* tg = targets.data<int32_t>();
      T* DX = d_logits.data<T>();
      for (int64_t r = 0; r < rows; ++r) {
        const bool valid = tg[r] != ignore_index;
        for (int64_t j = 0; j < V; ++j) {
          const double p = valid ? std::exp(static_cast<double>(X[r * V + j]) - L[r]) : 0.0;
          const double onehot = (valid && j + vocab_offset == tg[r]) ? 1.0 : 0.0;
          DX[r * V + j] = static_cast<T>((p - onehot) * grad_scale);
        }
      }
    });
  }

  void attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) override {
    const AttentionMergeDims d = check_attention_merge(block_out, block_lse, out, lse);
    constexpr double kNegInf = -std::numeric_limits<double>::infinity();
    dispatch_float(out, [&]<typename T>() {
      T *O = out.data<T>(), *L = lse.data<T>();
      const T *BO = block_out.data<T>(), *BL = block_lse.data<T>();
      for (int64_t b = 0; b < d.batch; ++b)
        for (int64_t h = 0; h < d.n_h; ++h)
          for (int64_t i = 0; i < d.sq; ++i) {
            const int64_t li = (b * d.n_h + h) * d.sq + i, oi = ((b * d.sq + i) * d.n_h + h) * d.d;
            const double a = L[li], c = BL[li];
            if (c == kNegInf) continue;
            if (a == kNegInf) {
              for (int64_t e = 0; e < d.d; ++e) O[oi + e] = BO[oi + e];
              L[li] = BL[li];
              continue;
            }
            const double m = std::max(a, c), ea = std::exp(a - m), ec = std::exp(c - m), s = ea + ec;
            const double wa = ea / s, wc = ec / s;
            for (int64_t e = 0; e < d.d; ++e) O[oi + e] = static_cast<T>(wa * O[oi + e] + wc * BO[oi + e]);
            L[li] = static_cast<T>(m + std::log(s));
          }
    });
  }

  void softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) override {
    const int64_t n = check_softmax_rescale(local_max, global_max, row_sum);
    dispatch_float(row_sum, [&]<typename T>() {
      const T *LM = local_max.data<T>(), *GM = global_max.data<T>();
      T* RS = row_sum.data<T>();
      for (int64_t i = 0; i < n; ++i)
        RS[i] = static_cast<T>(RS[i] * std::exp(static_cast<double>(LM[i]) - static_cast<double>(GM[i])));
    });
  }
  LossSums cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                const Tensor& targets, int32_t ignore_index, Tensor& lse) override {
    const int64_t n = check_cross_entropy_finish(row_max, row_sum, target_logit, targets, lse);
    LossSums sums;
    dispatch_float(lse, [&]<typename T>() {
      const T *M = row_max.data<T>(), *S = row_sum.data<T>(), *TL = target_logit.data<T>();
      const int32_t* tg = targets.data<int32_t>();
      T* L = lse.data<T>();
      for (int64_t i = 0; i < n; ++i) {
        L[i] = static_cast<T>(static_cast<double>(M[i]) + std::log(static_cast<double>(S[i])));
        if (tg[i] == ignore_index) continue;
        sums.loss_sum += static_cast<double>(L[i]) - static_cast<double>(TL[i]);
        ++sums.valid_tokens;
      }
    });
    return sums;
  }
  // The MoE ops: backend/cpu/moe_ops.h.
  void moe_route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights,
                         Tensor& experts) override {
    moe_reference::route_forward(logits, normalize, probs, weights, experts);
  }
  void moe_route_backward(const MoeRouteGrad& g, Tensor& d_logits) override { moe_reference::route_backward(g, d_logits); }
  void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override {
    moe_reference::gather_rows(src, rows, scale, dst);
  }
  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override {
    moe_reference::scatter_add_rows(src, rows, scale, dst);
  }
  void rows_dot(const Tensor& a, const Tensor& b, Tensor& out) override { moe_reference::rows_dot(a, b, out); }
  void sigmoid_forward(const Tensor& x, Tensor& y) override { moe_reference::sigmoid_forward(x, y); }
  void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    moe_reference::sigmoid_backward(y, dy, dx);
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
    const int64_t rows = check_softmax_chunk_update(logits, targets, row_max, row_sum, target_logit),
                  V = logits.dim(-1);
    dispatch_float(logits, [&]<typename T>() {
      const T* X = logits.data<T>();
      const int32_t* tg = targets.data<int32_t>();
      T *M = row_max.data<T>(), *Ssum = row_sum.data<T>(), *TL = target_logit.data<T>();
      for (int64_t r = 0; r < rows; ++r) {
        double cm = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < V; ++j) cm = std::max(cm, static_cast<double>(X[r * V + j]));
        const double m_old = M[r], m_new = std::max(m_old, cm);
        double s = m_old == -std::numeric_limits<double>::infinity() ? 0.0 : Ssum[r] * std::exp(m_old - m_new);
        for (int64_t j = 0; j < V; ++j) s += std::exp(X[r * V + j] - m_new);
        M[r] = static_cast<T>(m_new);
        Ssum[r] = static_cast<T>(s);
        const int64_t t = tg[r] - vocab_offset;
        if (tg[r] != ignore_index && t >= 0 && t < V) TL[r] = X[r * V + t];
      }
    });
  }
};

}  // namespace

std::unique_ptr<Backend> make_reference_backend() { return std::make_unique<ReferenceBackend>(); }

}  // namespace foldpar
