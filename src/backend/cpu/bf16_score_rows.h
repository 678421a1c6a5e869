// The bf16 attention kernel's per-score work (flash_attention_bf16.cc), fused with the rounding
// of its results to bf16: each row's probabilities and score gradients go from registers
// straight to the bf16 operand of the next tile product, with no f32 copy written and read
// back by a separate rounding pass.
//
// Two builds of each function, with the same contract:
// - AVX-512 with AVX512_BF16 (the build targets the machine, cmake/flags.cmake): explicit
//   intrinsics, e^x from a degree-4 polynomial and vscalefps (exp16 below), rounding by
//   vcvtneps2bf16 (to nearest even);
// - anywhere else: the f32 kernel's scalar steps (vec::exp, f32_to_bf16), which GCC vectorizes.
// The two differ only where e^x does (relative 6e-6 against 2.4e-7, both far below bf16's
// half ulp of 2^-9 relative), so a bf16 result differs by at most one ulp where a value lies
// that close to a rounding boundary; tests/unit/bf16_score_rows_test.cc holds them to it.
#pragma once

#include <cstdint>

#include "backend/cpu/bf16_round.h"  // the intrinsics and FOLDPAR_AVX512_BF16
#include "backend/cpu/flash_attention_tiles.h"
#include "backend/cpu/vec_math.h"
#include "tensor/dtype.h"

namespace foldpar::flash {

#if defined(FOLDPAR_AVX512_BF16)
constexpr bool kScoreRowsAvx512 = true;

// e^x on 16 lanes for results that are rounded to bf16 next. Relative error below 6e-6 on
// [-87.3, 88.7] (degree-4 polynomial with 1 + r fixed, fitted for relative error on
// |r| <= ln2/2: 5.4e-6, plus f32 rounding); exactly 1 at x = 0; exactly 0 for x < -87.3,
// -inf included (a masked score), where vec::exp is 0 too; NaN stays NaN. Above 88.7 it
// saturates at e^88.7 like vec::exp.
inline __m512 exp16(__m512 x) {
  // vmaxps / vminps return their second operand when either is NaN: x second keeps a NaN.
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-87.3f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2 with ln2 in two parts (Cody-Waite), as vec::exp does.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(0.04127681627869606f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.16753341257572174f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5000510811805725f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  // p * 2^n: over the clamped range n is in [-126, 128] and p in [0.7, 1.42], a normal float.
  const __m512 e = _mm512_scalef_ps(p, n);
  return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ), _mm512_setzero_ps());
}

// The first `n` of 16 lanes (n in [0, 16]).
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

inline void store_bf16(bf16* dst, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(dst, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#else
constexpr bool kScoreRowsAvx512 = false;
#endif

// P = e^(s - shift) for s[0, n) (masked scores already -inf, so 0): P rounded to bf16 into
// p[0, n); returns the f32 sum of the unrounded P.
inline float exp_sum_round(const float* s, float shift, int64_t n, bf16* p) {
#if defined(FOLDPAR_AVX512_BF16)
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += kLanes) {
    const __mmask16 m = first_lanes(std::min<int64_t>(kLanes, n - j));
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), sh));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    store_bf16(p + j, e, m);
  }
  return _mm512_reduce_add_ps(sum);
#else
  return exp_and_sum_into(s, shift, n, [p](int64_t j, float e) { p[j] = f32_to_bf16(e); });
#endif
}

// One key's column of the backward's tile, held as a row: the kernel computes S^T = K Q^T and
// dP^T = V dO^T ([keys, rows]), so that the products that need P^T and dS^T (dV, dK, and dQ^T)
// read them untransposed, oneDNN's fast path (flash_attention_bf16.cc). For query rows r in
// [0, n), from the scores s and dP, both f32 [n]: P = e^(s[r] - lse[r]), 0 where the key (at
// position k_pos) is hidden from row r (kMasked: outside [lo[r], hi[r]]), and
// dS = P * (dP[r] - delta[r]) from the f32 P, each rounded to bf16 into p[0, n) and ds[0, n).
// Nothing f32 is written: both products' operands come out of registers.
template <bool kMasked>
void key_probabilities_and_grads_round(const float* s, const float* dp, int32_t k_pos, const int32_t* lo,
                                       const int32_t* hi, int64_t n, const float* lse, const float* delta, bf16* p,
                                       bf16* ds) {
#if defined(FOLDPAR_AVX512_BF16)
  const __m512i k = _mm512_set1_epi32(k_pos);
  for (int64_t r = 0; r < n; r += kLanes) {
    const __mmask16 m = first_lanes(std::min<int64_t>(kLanes, n - r));
    __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + r), _mm512_maskz_loadu_ps(m, lse + r)));
    if constexpr (kMasked) {
      const __mmask16 seen = _mm512_mask_cmple_epi32_mask(m, k, _mm512_maskz_loadu_epi32(m, hi + r)) &
                             _mm512_mask_cmpge_epi32_mask(m, k, _mm512_maskz_loadu_epi32(m, lo + r));
      e = _mm512_maskz_mov_ps(seen, e);
    }
    store_bf16(p + r, e, m);
    const __m512 g = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, dp + r), _mm512_maskz_loadu_ps(m, delta + r));
    store_bf16(ds + r, _mm512_mul_ps(e, g), m);
  }
#else
  for (int64_t r = 0; r < n; ++r) {
    const float e = kMasked && hidden(k_pos, KeyBound{lo[r], hi[r]}) ? 0.0f : vec::exp(s[r] - lse[r]);
    p[r] = f32_to_bf16(e);
    ds[r] = f32_to_bf16(e * (dp[r] - delta[r]));
  }
#endif
}

}  // namespace foldpar::flash
