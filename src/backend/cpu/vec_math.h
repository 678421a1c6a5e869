// Elementwise math written so that GCC vectorizes the loops that call it (-O3, no
// fast-math): branch-free, no library calls. Accuracy is stated per function and is what
// the op parity tests rely on.
#pragma once

#include <bit>
#include <cstdint>

namespace foldpar::vec {

// e^x for f32 with relative error below 2 ulp on [-87.3, 88.7]; returns exactly 0 for
// x < -87.3 (including -inf, so masked scores vanish) and saturates above 88.7.
// Range reduction x = n ln2 + r (Cody-Waite, two-part ln2), degree-6 minimax polynomial on
// |r| <= ln2/2, then scaling by 2^n through the exponent bits.
inline float exp(float x) {
  const float xc = x > 88.7f ? 88.7f : (x < -87.3f ? -87.3f : x);
  // Round-to-nearest via the 1.5 * 2^23 trick (valid for |v| < 2^22).
  const float kRound = 12582912.0f;
  const float n = (xc * 1.44269504088896341f + kRound) - kRound;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  const float result = e * std::bit_cast<float>(bits);
  return x < -87.3f ? 0.0f : result;
}

// silu(x) = x * sigmoid(x), sigmoid through vec::exp.
inline float sigmoid(float x) { return 1.0f / (1.0f + vec::exp(-x)); }

}  // namespace foldpar::vec
