// The Backend's default many-tensor ops: the single-tensor op on each tensor in order (so
// their results are the single-tensor ops' bit for bit). Backends that launch kernels
// override them to do the work in one launch (backend/cuda/cuda_backend.cc).
#include "backend/backend.h"

#include "core/check.h"

namespace foldpar {

void Backend::fill_many(double value, std::span<Tensor* const> ys) {
  for (Tensor* y : ys) fill(value, *y);
}

void Backend::sum_squares_many(std::span<const Tensor* const> xs, std::span<double> out) {
  FP_CHECK(xs.size() == out.size(), "sum_squares_many: {} tensors but {} results", xs.size(), out.size());
  for (size_t i = 0; i < xs.size(); ++i) out[i] = sum_squares(*xs[i]);
}

void Backend::adamw_update_many(const AdamWStep& s, std::span<const AdamWTensors> ts) {
  for (const AdamWTensors& t : ts) {
    AdamWStep one = s;
    if (!t.decay) one.weight_decay = 0;
    adamw_update(one, *t.grad, *t.param, *t.m, *t.v);
    if (t.rounded != nullptr) copy(*t.param, *t.rounded);
  }
}

}  // namespace foldpar
