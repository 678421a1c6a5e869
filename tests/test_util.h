// Helpers shared by tests: deterministic random tensors and tolerance-policy assertions.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "core/rng.h"
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

}  // namespace foldpar::testing
