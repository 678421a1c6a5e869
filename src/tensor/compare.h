// Comparing tensors under the tolerance policy of core/tolerance.h.
#pragma once

#include <string>

#include "tensor/tensor.h"

namespace foldpar {

// max_i |a_i - ref_i| / max(max_i |ref_i|, 1e-30); +inf when shapes differ or any value is
// NaN/Inf where the reference is finite. f32, f64 and bf16 tensors, in any mix.
double max_rel_error(const Tensor& a, const Tensor& ref);

// The first `limit` elements whose error exceeds tol * max|ref|, as
// "[index] got a, want b (|diff| d > tol t)" lines, for failure messages.
std::string describe_mismatches(const Tensor& a, const Tensor& ref, double tol, int limit = 5);

}  // namespace foldpar
