// The reference MoE ops: the plainest loops, f64 arithmetic, f32 and f64 tensors. The top-k
// is k passes of "largest not yet taken", comparing the stored (rounded) probabilities with
// a strict >, so equal probabilities go to the lower expert index.
#include <cmath>
#include <vector>

#include "backend/cpu/dispatch_float.h"
#include "backend/cpu/moe_ops.h"
#include "backend/op_checks.h"

namespace foldpar::moe_reference {
namespace {

template <typename T>
double scale_at(const Tensor* scale, int64_t i) {
  return scale == nullptr ? 1.0 : static_cast<double>(scale->data<T>()[i]);
}

}  // namespace

void route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights, Tensor& experts) {
  const MoeRouteDims d = check_moe_route_forward(logits, probs, weights, experts);
  dispatch_float(logits, [&]<typename T>() {
    const T* L = logits.data<T>();
    T *P = probs.data<T>(), *W = weights.data<T>();
    int32_t* X = experts.data<int32_t>();
    for (int64_t t = 0; t < d.rows; ++t) {
      const T* l = L + t * d.experts;
      T* p = P + t * d.experts;
      double m = -INFINITY, sum = 0;
      for (int64_t e = 0; e < d.experts; ++e) m = std::max(m, static_cast<double>(l[e]));
      for (int64_t e = 0; e < d.experts; ++e) sum += std::exp(static_cast<double>(l[e]) - m);
      for (int64_t e = 0; e < d.experts; ++e) p[e] = static_cast<T>(std::exp(static_cast<double>(l[e]) - m) / sum);
      std::vector<bool> taken(static_cast<size_t>(d.experts), false);
      double chosen_sum = 0;
      for (int64_t j = 0; j < d.k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < d.experts; ++e)
          if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = true;
        X[t * d.k + j] = static_cast<int32_t>(best);
        chosen_sum += static_cast<double>(p[best]);
      }
      for (int64_t j = 0; j < d.k; ++j) {
        const double w = static_cast<double>(p[X[t * d.k + j]]);
        W[t * d.k + j] = static_cast<T>(normalize ? w / chosen_sum : w);
      }
    }
  });
}

void route_backward(const Backend::MoeRouteGrad& g, Tensor& d_logits) {
  const MoeRouteDims d = check_moe_route_backward(g, d_logits);
  dispatch_float(d_logits, [&]<typename T>() {
    const T *P = g.probs->data<T>(), *W = g.weights->data<T>(), *DW = g.d_weights->data<T>();
    const int32_t* X = g.experts->data<int32_t>();
    T* DL = d_logits.data<T>();
    std::vector<double> dp(static_cast<size_t>(d.experts));
    for (int64_t t = 0; t < d.rows; ++t) {
      const T* p = P + t * d.experts;
      for (int64_t e = 0; e < d.experts; ++e)
        dp[e] = g.d_probs_bias == nullptr ? 0.0 : static_cast<double>(g.d_probs_bias->data<T>()[e]);
      // w_j = p_j / s with s = sum of the chosen p: dp_j = (dw_j - sum_m dw_m w_m) / s.
      double s = 0, dot = 0;
      for (int64_t j = 0; j < d.k; ++j) {
        const int32_t e = X[t * d.k + j];
        check_row_id(e, d.experts, t * d.k + j, "moe_route_backward");
        s += static_cast<double>(p[e]);
        dot += static_cast<double>(DW[t * d.k + j]) * static_cast<double>(W[t * d.k + j]);
      }
      for (int64_t j = 0; j < d.k; ++j) {
        const double dw = DW[t * d.k + j];
        dp[X[t * d.k + j]] += g.normalize ? (dw - dot) / s : dw;
      }
      // p = softmax(l): dl_e = p_e (dp_e - sum_m p_m dp_m).
      double pdp = 0;
      for (int64_t e = 0; e < d.experts; ++e) pdp += static_cast<double>(p[e]) * dp[e];
      for (int64_t e = 0; e < d.experts; ++e)
        DL[t * d.experts + e] = static_cast<T>(static_cast<double>(p[e]) * (dp[e] - pdp));
    }
  });
}

void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) {
  const RowsDims d = check_gather_rows(src, rows, scale, dst);
  dispatch_float(src, [&]<typename T>() {
    const T* S = src.data<T>();
    const int32_t* R = rows.data<int32_t>();
    T* D = dst.data<T>();
    for (int64_t i = 0; i < d.m; ++i) {
      check_row_id(R[i], d.n, i, "gather_rows");
      const double a = scale_at<T>(scale, i);
      for (int64_t j = 0; j < d.width; ++j)
        D[i * d.width + j] = static_cast<T>(a * static_cast<double>(S[R[i] * d.width + j]));
    }
  });
}

void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) {
  const RowsDims d = check_scatter_add_rows(src, rows, scale, dst);
  dispatch_float(src, [&]<typename T>() {
    const T* S = src.data<T>();
    const int32_t* R = rows.data<int32_t>();
    T* D = dst.data<T>();
    for (int64_t i = 0; i < d.m; ++i) {
      check_row_id(R[i], d.n, i, "scatter_add_rows");
      const double a = scale_at<T>(scale, i);
      for (int64_t j = 0; j < d.width; ++j) {
        T& out = D[R[i] * d.width + j];
        out = static_cast<T>(static_cast<double>(out) + a * static_cast<double>(S[i * d.width + j]));
      }
    }
  });
}

void rows_dot(const Tensor& a, const Tensor& b, Tensor& out) {
  const int64_t m = check_rows_dot(a, b, out), w = a.dim(-1);
  dispatch_float(a, [&]<typename T>() {
    const T *A = a.data<T>(), *B = b.data<T>();
    T* O = out.data<T>();
    for (int64_t i = 0; i < m; ++i) {
      double acc = 0;
      for (int64_t j = 0; j < w; ++j) acc += static_cast<double>(A[i * w + j]) * static_cast<double>(B[i * w + j]);
      O[i] = static_cast<T>(acc);
    }
  });
}

void sigmoid_forward(const Tensor& x, Tensor& y) {
  check_same(x, y, "sigmoid y");
  dispatch_float(x, [&]<typename T>() {
    const T* X = x.data<T>();
    T* Y = y.data<T>();
    for (int64_t i = 0; i < x.numel(); ++i) Y[i] = static_cast<T>(1.0 / (1.0 + std::exp(-static_cast<double>(X[i]))));
  });
}

void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  check_same(y, dy, "sigmoid_backward dy");
  check_same(y, dx, "sigmoid_backward dx");
  dispatch_float(y, [&]<typename T>() {
    const T *Y = y.data<T>(), *DY = dy.data<T>();
    T* DX = dx.data<T>();
    for (int64_t i = 0; i < y.numel(); ++i) {
      const double s = Y[i];
      DX[i] = static_cast<T>(static_cast<double>(DY[i]) * s * (1.0 - s));
    }
  });
}

}  // namespace foldpar::moe_reference
