// Normwise relative error and mismatch reports.
#include "tensor/compare.h"

#include <cmath>
#include <limits>

namespace foldpar {
namespace {

double at(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kF32: return t.data<float>()[i];
    case DType::kF64: return t.data<double>()[i];
    case DType::kBF16: return bf16_to_f32(t.data<bf16>()[i]);
    case DType::kI32: return t.data<int32_t>()[i];
    case DType::kI64: return static_cast<double>(t.data<int64_t>()[i]);
  }
  return 0;
}

double ref_scale(const Tensor& ref) {
  double scale = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double v = std::abs(at(ref, i));
    if (std::isfinite(v)) scale = std::max(scale, v);  // -inf entries (an lse with no keys) must match exactly
  }
  return std::max(scale, 1e-30);
}

}  // namespace

double max_rel_error(const Tensor& a, const Tensor& ref) {
  if (a.numel() != ref.numel()) return std::numeric_limits<double>::infinity();
  const double scale = ref_scale(ref);
  double worst = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = at(a, i), y = at(ref, i);
    if (std::isnan(y) && std::isnan(x)) continue;
    if (x == y) continue;  // covers equal infinities
    const double diff = std::abs(x - y);
    if (!std::isfinite(diff)) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

std::string describe_mismatches(const Tensor& a, const Tensor& ref, double tol, int limit) {
  if (a.numel() != ref.numel()) return fmt::format("shape {} vs {}", a.describe(), ref.describe());
  const double scale = ref_scale(ref);
  std::string out;
  int shown = 0;
  for (int64_t i = 0; i < a.numel() && shown < limit; ++i) {
    const double x = at(a, i), y = at(ref, i), diff = std::abs(x - y);
    if (x == y || !(diff <= tol * scale)) {
      if (x == y) continue;
      out += fmt::format("[{}] got {:.9g}, want {:.9g} (|diff| {:.3g} > tol {:.3g} * max|ref| {:.3g})\n", i, x, y,
                         diff, tol, scale);
      ++shown;
    }
  }
  return out;
}

}  // namespace foldpar
