// Helpers shared by tests: deterministic random tensors and tolerance-policy assertions.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>

#include "core/rng.h"
#include "core/tolerance.h"
#include "tensor/compare.h"
#include "tensor/tensor.h"

namespace foldpar::testing {

// N(0, scale^2) values from (seed, stream), in f32 or f64.
inline Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, double scale = 1.0,
                            MemCategory cat = MemCategory::kWorkspace) {
  Tensor t = Tensor::empty(shape, dtype, cat);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double v = scale * normal_at(seed, 17, static_cast<uint64_t>(i));
    if (dtype == DType::kF64) {
      t.data<double>()[i] = v;
    } else {
      t.data<float>()[i] = static_cast<float>(v);
    }
  }
  return t;
}

inline Tensor i32_tensor(const Shape& shape, std::initializer_list<int32_t> values) {
  Tensor t = Tensor::empty(shape, DType::kI32, MemCategory::kWorkspace);
  int64_t i = 0;
  for (int32_t v : values) t.data<int32_t>()[i++] = v;
  EXPECT_EQ(i, t.numel());
  return t;
}

inline Tensor iota_i32(int64_t n, int32_t start = 0) {
  Tensor t = Tensor::empty({n}, DType::kI32, MemCategory::kWorkspace);
  for (int64_t i = 0; i < n; ++i) t.data<int32_t>()[i] = start + static_cast<int32_t>(i);
  return t;
}

// Asserts max_rel_error(got, want) <= tol, printing the first mismatches otherwise.
inline ::testing::AssertionResult near_rel(const Tensor& got, const Tensor& want, double tol) {
  const double err = max_rel_error(got, want);
  if (err <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "relative error " << err << " > " << tol << "\n"
                                       << describe_mismatches(got, want, tol);
}

// Compares `analytic` (d loss / d param, f64) with central differences of loss() at up to
// `samples` elements of param, every n/samples-th from `first` (all of them when the tensor
// has at most `samples`), against tol::kF64FiniteDifference relative to the largest
// analytic value.
inline void expect_gradient(const std::string& what, Tensor& param, const Tensor& analytic,
                            const std::function<double()>& loss, int samples = 64, int64_t first = 3) {
  ASSERT_EQ(param.dtype(), DType::kF64);
  double* p = param.data<double>();
  const int64_t n = param.numel();
  const int64_t stride = std::max<int64_t>(1, n / samples);
  double scale = 1e-30, worst = 0;
  for (int64_t i = 0; i < n; ++i) scale = std::max(scale, std::abs(analytic.data<double>()[i]));
  int64_t worst_i = -1;
  double worst_num = 0;
  for (int64_t i = (n > samples ? first % n : 0); i < n; i += stride) {
    const double saved = p[i], h = tol::kFiniteDifferenceStep;
    p[i] = saved + h;
    const double up = loss();
    p[i] = saved - h;
    const double down = loss();
    p[i] = saved;
    const double numeric = (up - down) / (2 * h);
    const double err = std::abs(numeric - analytic.data<double>()[i]) / scale;
    if (err > worst) {
      worst = err;
      worst_i = i;
      worst_num = numeric;
    }
  }
  EXPECT_LE(worst, tol::kF64FiniteDifference)
      << what << ": worst at [" << worst_i << "] numeric " << worst_num << " analytic "
      << (worst_i >= 0 ? analytic.data<double>()[worst_i] : 0.0) << " (scale " << scale << ")";
}

}  // namespace foldpar::testing
