// The fast CPU backend's MoE ops, f32: the top-k by a partial sort of expert ids (ordered by
// probability, then id, so ties go to the lower index), row copies by memcpy where no scale
// applies. Held to moe_reference.cc by backend_moe_ops_test.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "backend/cpu/moe_ops.h"
#include "backend/cpu/vec_math.h"
#include "backend/op_checks.h"

namespace foldpar::moe_cpu {
namespace {
void check_f32(const Tensor& t, const char* what) {
  FP_CHECK(t.dtype() == DType::kF32, "cpu backend {}: {} is not f32", what, t.describe());
}
}  // namespace

void route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights, Tensor& experts) {
  const MoeRouteDims d = check_moe_route_forward(logits, probs, weights, experts);
  check_f32(logits, "moe_route_forward");
  const float* L = logits.data<float>();
  float *P = probs.data<float>(), *W = weights.data<float>();
  int32_t* X = experts.data<int32_t>();
  std::vector<int32_t> order(static_cast<size_t>(d.experts));
  for (int64_t t = 0; t < d.rows; ++t) {
    const float* l = L + t * d.experts;
    float* p = P + t * d.experts;
    const float m = *std::max_element(l, l + d.experts);
    double sum = 0;
    for (int64_t e = 0; e < d.experts; ++e) sum += std::exp(static_cast<double>(l[e] - m));
    for (int64_t e = 0; e < d.experts; ++e) p[e] = static_cast<float>(std::exp(static_cast<double>(l[e] - m)) / sum);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + d.k, order.end(),
                      [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    double chosen = 0;
    for (int64_t j = 0; j < d.k; ++j) chosen += p[order[j]];
    for (int64_t j = 0; j < d.k; ++j) {
      X[t * d.k + j] = order[j];
      W[t * d.k + j] = normalize ? static_cast<float>(p[order[j]] / chosen) : p[order[j]];
    }
  }
}

void route_backward(const Backend::MoeRouteGrad& g, Tensor& d_logits) {
  const MoeRouteDims d = check_moe_route_backward(g, d_logits);
  check_f32(d_logits, "moe_route_backward");
  const float *P = g.probs->data<float>(), *W = g.weights->data<float>(), *DW = g.d_weights->data<float>();
  const float* bias = g.d_probs_bias == nullptr ? nullptr : g.d_probs_bias->data<float>();
  const int32_t* X = g.experts->data<int32_t>();
  float* DL = d_logits.data<float>();
  std::vector<double> dp(static_cast<size_t>(d.experts));
  for (int64_t t = 0; t < d.rows; ++t) {
    const float* p = P + t * d.experts;
    const int32_t* x = X + t * d.k;
    for (int64_t e = 0; e < d.experts; ++e) dp[e] = bias == nullptr ? 0.0 : bias[e];
    double s = 0, dot = 0;
    for (int64_t j = 0; j < d.k; ++j) {
      check_row_id(x[j], d.experts, t * d.k + j, "moe_route_backward");
      s += p[x[j]];
      dot += static_cast<double>(DW[t * d.k + j]) * W[t * d.k + j];
    }
    const double inv_s = 1.0 / s;
    for (int64_t j = 0; j < d.k; ++j) dp[x[j]] += g.normalize ? (DW[t * d.k + j] - dot) * inv_s : DW[t * d.k + j];
    double pdp = 0;
    for (int64_t e = 0; e < d.experts; ++e) pdp += p[e] * dp[e];
    for (int64_t e = 0; e < d.experts; ++e) DL[t * d.experts + e] = static_cast<float>(p[e] * (dp[e] - pdp));
  }
}

void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) {
  const RowsDims d = check_gather_rows(src, rows, scale, dst);
  check_f32(src, "gather_rows");
  const float* S = src.data<float>();
  const int32_t* R = rows.data<int32_t>();
  const float* A = scale == nullptr ? nullptr : scale->data<float>();
  float* D = dst.data<float>();
  for (int64_t i = 0; i < d.m; ++i) {
    check_row_id(R[i], d.n, i, "gather_rows");
    const float* s = S + R[i] * d.width;
    float* o = D + i * d.width;
    if (A == nullptr) {
      std::memcpy(o, s, static_cast<size_t>(d.width) * sizeof(float));
    } else {
      for (int64_t j = 0; j < d.width; ++j) o[j] = A[i] * s[j];
    }
  }
}

void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) {
  const RowsDims d = check_scatter_add_rows(src, rows, scale, dst);
  check_f32(src, "scatter_add_rows");
  const float* S = src.data<float>();
  const int32_t* R = rows.data<int32_t>();
  const float* A = scale == nullptr ? nullptr : scale->data<float>();
  float* D = dst.data<float>();
  for (int64_t i = 0; i < d.m; ++i) {
    check_row_id(R[i], d.n, i, "scatter_add_rows");
    const float a = A == nullptr ? 1.0f : A[i];
    const float* s = S + i * d.width;
    float* o = D + R[i] * d.width;
    for (int64_t j = 0; j < d.width; ++j) o[j] += a * s[j];
  }
}

void rows_dot(const Tensor& a, const Tensor& b, Tensor& out) {
  const int64_t m = check_rows_dot(a, b, out), w = a.dim(-1);
  check_f32(a, "rows_dot");
  const float *A = a.data<float>(), *B = b.data<float>();
  float* O = out.data<float>();
  for (int64_t i = 0; i < m; ++i) {
    double acc = 0;
    for (int64_t j = 0; j < w; ++j) acc += static_cast<double>(A[i * w + j]) * B[i * w + j];
    O[i] = static_cast<float>(acc);
  }
}

void sigmoid_forward(const Tensor& x, Tensor& y) {
  check_same(x, y, "sigmoid y");
  check_f32(x, "sigmoid");
  const float* X = x.data<float>();
  float* Y = y.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) Y[i] = vec::sigmoid(X[i]);
}

void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  check_same(y, dy, "sigmoid_backward dy");
  check_same(y, dx, "sigmoid_backward dx");
  check_f32(y, "sigmoid_backward");
  const float *Y = y.data<float>(), *DY = dy.data<float>();
  float* DX = dx.data<float>();
  for (int64_t i = 0; i < y.numel(); ++i) DX[i] = DY[i] * Y[i] * (1.0f - Y[i]);
}

}  // namespace foldpar::moe_cpu
