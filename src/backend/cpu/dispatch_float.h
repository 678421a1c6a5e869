// The reference loops' element-type switch, shared by reference_backend.cc and
// moe_reference.cc.
#pragma once

#include "core/check.h"
#include "tensor/tensor.h"

namespace foldpar {

// Calls fn.template operator()<T>() with T the element type of t (f32 or f64).
template <typename Fn>
void dispatch_float(const Tensor& t, Fn&& fn) {
  if (t.dtype() == DType::kF32) {
    fn.template operator()<float>();
  } else {
    FP_CHECK(t.dtype() == DType::kF64, "reference backend: {} is not f32/f64", t.describe());
    fn.template operator()<double>();
  }
}

}  // namespace foldpar
