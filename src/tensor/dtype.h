// Element types and bf16 conversion. Compute is f32 (f64 for the reference path and finite
// differences); bf16 is a storage type only: values are widened to f32 before arithmetic.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace foldpar {

enum class DType : uint8_t { kF32, kF64, kBF16, kI32, kI64 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

// Safetensors spelling: "F32", "F64", "BF16", "I32", "I64".
std::string_view dtype_name(DType t);
bool dtype_from_name(std::string_view name, DType* out);

template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::kF32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::kF64; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::kI32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::kI64; };

// bf16 as raw bits. Conversion from f32 rounds to nearest even; NaN stays NaN.
struct bf16 {
  uint16_t bits;
};
template <> struct DTypeOf<bf16> { static constexpr DType value = DType::kBF16; };

// Branch-free (a select), so that loops of conversions vectorize.
constexpr bf16 f32_to_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t nearest = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return bf16{static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : nearest)};
}
constexpr float bf16_to_f32(bf16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.bits) << 16); }

}  // namespace foldpar
