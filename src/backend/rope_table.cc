// RoPE table construction: computed on the host (the angles are a function of host-known
// positions), then copied into the backend's memory.
#include "backend/rope_table.h"

#include <cmath>
#include <vector>

namespace foldpar {

namespace {

template <typename T>
void upload(Backend& be, const std::vector<T>& host, Tensor& table) {
  be.copy_from_host(std::as_bytes(std::span<const T>(host)), table);
}

}  // namespace

Tensor build_rope_table(Backend& be, std::span<const int32_t> positions, int64_t head_dim, double theta, DType dtype,
                        MemCategory category) {
  FP_CHECK(head_dim % 2 == 0, "head dim {} must be even for RoPE", head_dim);
  FP_CHECK(dtype == DType::kF32 || dtype == DType::kF64, "rope table dtype {}", dtype_name(dtype));
  const int64_t half = head_dim / 2;
  const int64_t n = static_cast<int64_t>(positions.size());
  Tensor table = Tensor::empty({n, 2, half}, dtype, category);
  if (dtype == DType::kF32) {
    std::vector<float> t(static_cast<size_t>(n * head_dim));
    for (int64_t i = 0; i < half; ++i) {
      // torch: 1.0 / (base ** (arange(0, d, 2).float() / d)), all in f32.
      const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
      const float inv_freq = 1.0f / static_cast<float>(std::pow(static_cast<double>(static_cast<float>(theta)),
                                                                static_cast<double>(exponent)));
      for (int64_t p = 0; p < n; ++p) {
        const float angle = static_cast<float>(positions[p]) * inv_freq;
        t[static_cast<size_t>((p * 2 + 0) * half + i)] = static_cast<float>(std::cos(static_cast<double>(angle)));
        t[static_cast<size_t>((p * 2 + 1) * half + i)] = static_cast<float>(std::sin(static_cast<double>(angle)));
      }
    }
    upload(be, t, table);
  } else {
    std::vector<double> t(static_cast<size_t>(n * head_dim));
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
      for (int64_t p = 0; p < n; ++p) {
        const double angle = positions[p] * inv_freq;
        t[static_cast<size_t>((p * 2 + 0) * half + i)] = std::cos(angle);
        t[static_cast<size_t>((p * 2 + 1) * half + i)] = std::sin(angle);
      }
    }
    upload(be, t, table);
  }
  return table;
}

}  // namespace foldpar
