// Rounding a run of f32 values to bf16 (to nearest even), the last step of every bf16
// token-wise op and attention output: vcvtneps2bf16 where the build targets AVX512_BF16, one
// instruction per 16 values instead of GCC's seven-op vectorization of f32_to_bf16.
// The same bits as f32_to_bf16 (tensor/dtype.h) for every normal, zero, infinite and NaN
// input; a subnormal input (below 1.2e-38 in magnitude) becomes a zero of its sign, as the
// instruction treats subnormals as zero (f32_to_bf16 would keep the nearest bf16 subnormal).
// tests/unit/bf16_score_rows_test.cc holds it to that.
#pragma once

#include <cstdint>

#include "tensor/dtype.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps(), which -Wmaybe-uninitialized
// reports where they inline (GCC bug 105593, fixed in GCC 13); the warning is checked against
// the intrinsic header's lines, so it is silenced where that header is read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define FOLDPAR_AVX512_BF16 1  // the intrinsics paths here and in bf16_score_rows.h
#endif

namespace foldpar {

inline void round_run_to_bf16(const float* src, int64_t n, bf16* dst) {
#if defined(FOLDPAR_AVX512_BF16)
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i))));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm256_mask_storeu_epi16(dst + i, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i))));
  }
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
#endif
}

}  // namespace foldpar
