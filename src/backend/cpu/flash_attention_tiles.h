// What the f32 and bf16 flash attention kernels (flash_attention.cc, flash_attention_bf16.cc)
// share: the visibility of tiles from position ranges, the recursive split of partially
// visible tiles, and the per-row softmax steps, all in f32 (the statistics of either kernel).
// Internal to those two files; nothing here allocates.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "backend/cpu/vec_math.h"
#include "tensor/dtype.h"

// The softmax loops below are written for 16 f32 lanes (the build adds
// -mprefer-vector-width=512, cmake/flags.cmake, so GCC uses them on AVX-512 CPUs).

namespace foldpar::flash {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMinTile = 32;  // smallest rows / keys of a split tile
constexpr int64_t kLanes = 16;    // f32 lanes of an AVX-512 register: width of the manual reductions

struct PosRange {
  int32_t lo, hi;
};

inline PosRange range_of(const int32_t* pos, int64_t n) {
  PosRange r{pos[0], pos[0]};
  for (int64_t i = 1; i < n; ++i) {
    r.lo = std::min(r.lo, pos[i]);
    r.hi = std::max(r.hi, pos[i]);
  }
  return r;
}

enum class Visibility { kNone, kPartial, kFull };

// Key j is visible to query i iff k_pos[j] <= q_pos[i] and, with a sliding window W > 0,
// q_pos[i] - k_pos[j] < W; over a whole tile this needs only the position ranges, whatever
// the order of the positions inside them. Differences in 64 bits: positions span all of i32.
inline Visibility classify(PosRange q, PosRange k, int64_t window) {
  if (k.lo > q.hi) return Visibility::kNone;
  if (window > 0 && int64_t{q.lo} - k.hi >= window) return Visibility::kNone;  // behind every window
  if (k.hi <= q.lo && (window == 0 || int64_t{q.hi} - k.lo < window)) return Visibility::kFull;
  return Visibility::kPartial;
}

// The key positions one query sees: [lo, hi]. hi is the query's position; lo that minus
// W - 1 with a window W, else the lowest i32.
struct KeyBound {
  int32_t lo, hi;
};
inline KeyBound key_bound(int32_t q_pos, int64_t window) {
  constexpr int64_t kLowest = std::numeric_limits<int32_t>::min();
  const int64_t lo = window > 0 ? std::max(kLowest, int64_t{q_pos} - window + 1) : kLowest;
  return {static_cast<int32_t>(lo), q_pos};
}
inline bool hidden(int32_t k_pos, KeyBound b) { return k_pos > b.hi || k_pos < b.lo; }

// Query tokens [t0, t0 + tokens) of the current q block (stacked rows t0 * g onwards) against
// keys [j0, j0 + keys).
struct Tile {
  int64_t t0, tokens, j0, keys;
};

// Calls step(tile, visibility) on the visible parts of `tile` of the q block at token i0
// (g stacked rows per token). A partially visible tile with an invisible quadrant (the upper
// right of a causal diagonal block) is split into quadrants, recursively down to kMinTile
// rows or keys; other tiles are processed whole.
template <typename Step>
void for_visible_tiles(const int32_t* q_pos, const int32_t* k_pos, int64_t window, int64_t g, int64_t i0,
                       const Tile& tile, Visibility vis, const Step& step) {
  if (vis == Visibility::kNone) return;
  auto half = [](int64_t n) { return std::min(n - 1, ((n + 1) / 2 + kLanes - 1) / kLanes * kLanes); };
  if (vis == Visibility::kPartial && tile.tokens >= 2 && tile.tokens * g >= 2 * kMinTile &&
      tile.keys >= 2 * kMinTile) {
    const int64_t th = half(tile.tokens), kh = half(tile.keys);
    const Tile quads[4] = {{tile.t0, th, tile.j0, kh},
                           {tile.t0, th, tile.j0 + kh, tile.keys - kh},
                           {tile.t0 + th, tile.tokens - th, tile.j0, kh},
                           {tile.t0 + th, tile.tokens - th, tile.j0 + kh, tile.keys - kh}};
    Visibility sub[4];
    bool any_none = false;
    for (int i = 0; i < 4; ++i) {
      const Tile& q = quads[i];
      sub[i] = classify(range_of(q_pos + i0 + q.t0, q.tokens), range_of(k_pos + q.j0, q.keys), window);
      any_none = any_none || sub[i] == Visibility::kNone;
    }
    if (any_none) {  // otherwise splitting would only make the products smaller
      for (int i = 0; i < 4; ++i) for_visible_tiles(q_pos, k_pos, window, g, i0, quads[i], sub[i], step);
      return;
    }
  }
  step(tile, vis);
}

// Calls step(tile, visibility) for the visible tiles of the q block at token i0 (`tokens`
// tokens) against every k block of `keys_per_block` keys; k_ranges holds each k block's
// (lo, hi) position range. Tiles wholly behind the window are skipped like those ahead of
// every query.
struct BlockPositions {
  const int32_t *q_pos, *k_pos, *k_ranges;
  int64_t sk, keys_per_block, window;
};
template <typename Step>
void for_each_k_block(const BlockPositions& bp, int64_t g, int64_t i0, int64_t tokens, const Step& step) {
  const PosRange qr = range_of(bp.q_pos + i0, tokens);
  for (int64_t j0 = 0, kb = 0; j0 < bp.sk; j0 += bp.keys_per_block, ++kb) {
    const Tile tile{0, tokens, j0, std::min(bp.keys_per_block, bp.sk - j0)};
    const PosRange kr{bp.k_ranges[2 * kb], bp.k_ranges[2 * kb + 1]};
    for_visible_tiles(bp.q_pos, bp.k_pos, bp.window, g, i0, tile, classify(qr, kr, bp.window), step);
  }
}

// ---- per-row softmax steps ----
// Reductions keep kLanes independent partial results so the loops vectorize without
// reassociating a sum; `unroll 1` keeps each lane loop whole for GCC's loop vectorizer
// (unrolled first, the SLP pass leaves these scalar).

// Max of x[0, n) after masking x[j] = -inf where key j is hidden from the query (bound).
template <bool kMasked>
float mask_and_max(float* x, const int32_t* k_pos, KeyBound bound, int64_t n) {
  float lanes[kLanes];
  std::fill_n(lanes, kLanes, kNegInf);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
#pragma GCC unroll 1
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = kMasked && hidden(k_pos[j + l], bound) ? kNegInf : x[j + l];
      if (kMasked) x[j + l] = v;
      lanes[l] = std::max(lanes[l], v);
    }
  }
  for (; j < n; ++j) {
    const float v = kMasked && hidden(k_pos[j], bound) ? kNegInf : x[j];
    if (kMasked) x[j] = v;
    lanes[0] = std::max(lanes[0], v);
  }
  return *std::max_element(lanes, lanes + kLanes);
}

// e^(x[j] - shift) for x[0, n), each handed to put(j, e) (x[j] itself may be overwritten);
// returns their sum.
template <typename Put>
float exp_and_sum_into(const float* x, float shift, int64_t n, const Put& put) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
#pragma GCC unroll 1
    for (int64_t l = 0; l < kLanes; ++l) {
      const float e = vec::exp(x[j + l] - shift);
      put(j + l, e);
      lanes[l] += e;
    }
  }
  for (; j < n; ++j) {
    const float e = vec::exp(x[j] - shift);
    put(j, e);
    lanes[0] += e;
  }
  float sum = 0;
  for (float v : lanes) sum += v;
  return sum;
}

// x[j] = e^(x[j] - shift) in place; returns their sum.
inline float exp_and_sum(float* x, float shift, int64_t n) {
  return exp_and_sum_into(x, shift, n, [x](int64_t j, float e) { x[j] = e; });
}

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return bf16_to_f32(x); }

// sum_j a[j] b[j] in f32 (f32 or bf16 operands).
template <typename T>
float dot(const T* a, const T* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
#pragma GCC unroll 1
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += widen(a[j + l]) * widen(b[j + l]);
  }
  for (; j < n; ++j) lanes[0] += widen(a[j]) * widen(b[j]);
  float sum = 0;
  for (float v : lanes) sum += v;
  return sum;
}

// The online-softmax step of one row of a tile: its scores s[0, keys) become probabilities
// relative to the updated running max m (exp_sum(shift) writes them where the kernel wants
// them and returns their sum); the running sum l and the accumulator row acc[0, d) are
// rescaled to that max.
template <bool kMasked, typename ExpSum>
void online_softmax_row(float* s, const int32_t* k_pos, KeyBound bound, int64_t keys, float& m, float& l, float* acc,
                        int64_t d, const ExpSum& exp_sum) {
  const float m_new = std::max(m, mask_and_max<kMasked>(s, k_pos, bound, keys));
  // A row that has seen no key yet keeps m = -inf; shifting by 0 keeps its e^-inf = 0.
  const float shift = m_new == kNegInf ? 0.0f : m_new;
  const float correction = vec::exp(m - shift);
  l = l * correction + exp_sum(shift);
  m = m_new;
  if (correction != 1.0f)
    for (int64_t e = 0; e < d; ++e) acc[e] *= correction;
}
// The f32 kernel's step: the probabilities in place in s.
template <bool kMasked>
void online_softmax_row(float* s, const int32_t* k_pos, KeyBound bound, int64_t keys, float& m, float& l, float* acc,
                        int64_t d) {
  online_softmax_row<kMasked>(s, k_pos, bound, keys, m, l, acc, d,
                              [s, keys](float shift) { return exp_and_sum(s, shift, keys); });
}

// P = e^(S - lse) (0 where masked) in place on one row of scores. A query that sees no key
// has lse = -inf, but every tile holding it is partial and masks all of its row.
template <bool kMasked>
void probabilities_row(float* s, const int32_t* k_pos, KeyBound bound, int64_t keys, float lse) {
  for (int64_t j = 0; j < keys; ++j) {
    const float e = vec::exp(s[j] - lse);
    s[j] = kMasked && hidden(k_pos[j], bound) ? 0.0f : e;
  }
}

// dS = P * (dP - delta) in place on one row of dP.
inline void score_grads_row(const float* p, float* ds, float delta, int64_t keys) {
  for (int64_t j = 0; j < keys; ++j) ds[j] = p[j] * (ds[j] - delta);
}

}  // namespace foldpar::flash
