// Elementwise math written so that GCC vectorizes the loops that call it (-O3, no
// fast-math): branch-free, no library calls. Accuracy is stated per function and is what
// the op parity tests rely on (tests/unit/vec_math_test.cc checks each claim).
#pragma once

#include <bit>
#include <cstdint>

namespace foldpar::vec {

// e^x for f32 with error below 2 ulp (relative error below 2.4e-7) on [-87.3, 88.7]; returns
// exactly 0 for x < -87.3 (including -inf, so masked scores vanish; the true values there
// are below 1.3e-38, at the bottom of the normal range) and saturates at e^88.7 (3.3e38)
// above 88.7. NaN gives NaN.
// Range reduction x = n ln2 + r (Cody-Waite, two-part ln2), degree-6 minimax polynomial on
// |r| <= ln2/2, then scaling by 2^n through the exponent bits.
inline float exp(float x) {
  const float xc = x > 88.7f ? 88.7f : (x < -87.3f ? -87.3f : x);
  // Round-to-nearest via the 1.5 * 2^23 trick (valid for |v| < 2^22): t's low mantissa
  // bits then hold n as an integer, read back without a float-to-int conversion.
  const float kRound = 12582912.0f;
  const float t = xc * 1.44269504088896341f + kRound;
  const float n = t - kRound;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  // e * 2^n by adding n to e's exponent field. Over the clamped range this stays a normal
  // float: e < 1 (exponent field 126) whenever n = 128 (x <= 88.7 < 128 ln2) and e > 1 (127)
  // whenever n = -126 (x >= -87.3 > -126 ln2). The low bits of t hold kRound's mantissa plus
  // n, and kRound's mantissa bits vanish in the shift, so t's bits shifted by 23 are n << 23.
  const float result = std::bit_cast<float>(std::bit_cast<uint32_t>(e) + (std::bit_cast<uint32_t>(t) << 23));
  // The exponent arithmetic would turn a NaN into a number: NaN is returned as is.
  return x >= -87.3f ? result : (x < -87.3f ? 0.0f : x);
}

// sigmoid(x) = 1 / (1 + e^-x) through vec::exp: relative error below 4 ulp where the result
// is at least 1e-37; exactly 1 for x > 87.3; for x < -88.7 it returns 1 / (1 + 3.3e38), a
// subnormal below 3.1e-39 (the true value is smaller still).
inline float sigmoid(float x) { return 1.0f / (1.0f + vec::exp(-x)); }

}  // namespace foldpar::vec
