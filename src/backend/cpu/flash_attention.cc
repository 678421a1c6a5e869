// Blocked ("flash") causal attention for f32 on one CPU thread, FlashAttention-2 style.
// For each (batch, kv head) the g = n_h / n_kv query heads sharing it are processed together:
// a q block stacks their rows (row r = token * g + head-in-group), so each K/V block is read
// once for all of them. Products are GEMM-engine calls (gemm_engine.h) on packed blocks; the
// softmax loops are plain loops that GCC vectorizes. Invariants: no Sq x Sk matrix is ever
// formed; the workspace is allocated (tracked) once per call: O(block) plus one kv head's K
// and V (and dK, dV) packed contiguous, i.e. O(Sk * d); a tile that no query sees (ahead of
// every query, or behind every query's sliding window) is skipped, and one that every query
// sees whole is not masked.
#include "backend/cpu/flash_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "backend/cpu/flash_attention_tiles.h"
#include "backend/cpu/gemm_engine.h"
#include "backend/cpu/vec_math.h"
#include "tensor/tensor.h"

namespace foldpar {
namespace {

using flash::kLanes;
using flash::kNegInf;
using flash::range_of;
using flash::Tile;
using flash::Visibility;

// Block sizes, tuned with bench/attention_bench.cc on Sapphire Rapids (48 KiB L1d, 2 MiB L2).
// OpenBLAS's efficiency grows with the block (256 x 256 x 128 runs at ~85% of its large-matrix
// rate, 128 x 128 x 128 at ~73%), while one block pair's working set (q, acc or dq, dO:
// rows x d; scores, dP: rows x keys; K, V: keys x d) must stay inside L2: about 1 MiB at
// d = 128. 128-row or 128-key blocks measured 5-10% slower; 384 and 512 no faster (within
// the machine's noise). A partially visible pair is split into quadrants down to kMinTile,
// so that the invisible half of a diagonal block costs little: +20% at S = 512, +5% at
// S = 2048 against no split; 32 beat 64 and 128 at S <= 2048.
constexpr int64_t kStackedRows = 256;  // rows of a q block: query tokens x GQA group
constexpr int64_t kKeyBlock = 256;     // keys of a k block

// Everything the block steps need about one call, and the workspace carved into buffers.
struct Plan {
  AttentionDims dims{};
  float scale = 0;
  const int32_t* q_pos = nullptr;
  const int32_t* k_pos = nullptr;
  int64_t tokens_per_q_block = 0;  // max(1, kStackedRows / g), at most Sq
  int64_t keys_per_block = 0;      // kKeyBlock, at most Sk; also the leading dimension of scores
  int64_t q_stride = 0;            // floats between consecutive tokens of q: n_h * d
  int64_t kv_stride = 0;           // ... of k and v: n_kv * d
  Tensor workspace, k_range_storage;
  const int32_t* k_ranges = nullptr;  // (lo, hi) position range of each k block, for every batch and head
  float* q_rows = nullptr;    // [rows, d]: the packed q block
  float* acc_rows = nullptr;  // [rows, d]: forward output accumulator / backward packed dO block
  float* dq_rows = nullptr;   // [rows, d]: backward dq accumulator
  float* scores = nullptr;    // [rows, keys_per_block]: S, then P
  float* d_scores = nullptr;  // [rows, keys_per_block]: dP, then dS (backward)
  float* row_a = nullptr;     // [rows]: running max m (forward) / lse (backward)
  float* row_b = nullptr;     // [rows]: running sum l (forward) / delta = rowsum(dO * O) (backward)
  // [Sk, d] each: one kv head's K, V (and dK, dV) packed contiguous. Strided rows (n_kv * d
  // floats apart) cost a TLB miss and a broken prefetch stream per key on every pass over
  // the keys (~8% at n_kv = 16). Null when n_kv == 1, where the rows are contiguous already.
  float *k_head = nullptr, *v_head = nullptr, *dk_head = nullptr, *dv_head = nullptr;
  int64_t rows_max() const { return tokens_per_q_block * dims.group(); }
};

int64_t tokens_per_q_block(const AttentionDims& d) { return std::max<int64_t>(1, std::min(kStackedRows / d.group(), d.sq)); }
int64_t keys_per_block(const AttentionDims& d) { return std::max<int64_t>(1, std::min(kKeyBlock, d.sk)); }

// Each buffer starts on a 64-byte line: sizes rounded up to whole lines of 16 floats.
struct BufferSizes {
  int64_t mat, sc, vec, head;
};
BufferSizes buffer_sizes(const AttentionDims& d) {
  auto line = [](int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; };
  const int64_t rows_max = tokens_per_q_block(d) * d.group();
  return {line(rows_max * d.d), line(rows_max * keys_per_block(d)), line(rows_max),
          d.n_kv * d.d == d.d ? 0 : line(d.sk * d.d)};
}

Plan make_plan(const AttentionDims& d, const int32_t* q_pos, const int32_t* k_pos, float scale, bool backward) {
  FP_CHECK(d.d > 0, "flash attention: head dim {} must be positive", d.d);
  Plan p;
  p.dims = d;
  p.scale = scale;
  p.q_pos = q_pos;
  p.k_pos = k_pos;
  p.tokens_per_q_block = tokens_per_q_block(d);
  p.keys_per_block = keys_per_block(d);
  p.q_stride = d.n_h * d.d;
  p.kv_stride = d.n_kv * d.d;
  const BufferSizes b = buffer_sizes(d);
  const int64_t mat = b.mat, sc = b.sc, vec = b.vec, head = b.head;
  const AttentionScratch scratch = cpu_flash_attention_scratch(d, backward);
  p.workspace = Tensor::empty({scratch.floats}, DType::kF32, MemCategory::kWorkspace);
  float* w = p.workspace.data<float>();
  auto take = [&w](int64_t n) { return std::exchange(w, w + n); };
  p.q_rows = take(mat);
  p.acc_rows = take(mat);
  p.scores = take(sc);
  p.row_a = take(vec);
  p.row_b = take(vec);
  if (backward) {
    p.dq_rows = take(mat);
    p.d_scores = take(sc);
  }
  if (head > 0) {
    p.k_head = take(head);
    p.v_head = take(head);
    if (backward) {
      p.dk_head = take(head);
      p.dv_head = take(head);
    }
  }
  const int64_t k_blocks = (d.sk + p.keys_per_block - 1) / p.keys_per_block;
  p.k_range_storage = Tensor::empty({scratch.range_ints}, DType::kI32, MemCategory::kWorkspace);
  int32_t* ranges = p.k_range_storage.data<int32_t>();
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const int64_t j0 = kb * p.keys_per_block;
    const flash::PosRange r = range_of(k_pos + j0, std::min(p.keys_per_block, d.sk - j0));
    ranges[2 * kb] = r.lo;
    ranges[2 * kb + 1] = r.hi;
  }
  p.k_ranges = ranges;
  return p;
}

// Offset of the rows of kv head group hk at query token i0 of batch b in q, out, d_out, dq:
// token t's g heads are contiguous (g * d floats), tokens q_stride apart.
size_t group_offset(const Plan& p, int64_t b, int64_t i0, int64_t hk) {
  return static_cast<size_t>(((b * p.dims.sq + i0) * p.dims.n_h + hk * p.dims.group()) * p.dims.d);
}
// Offset of key 0 of kv head hk of batch b in k, v, dk, dv.
size_t kv_head_offset(const Plan& p, int64_t b, int64_t hk) {
  return static_cast<size_t>((b * p.dims.sk * p.dims.n_kv + hk) * p.dims.d);
}

void pack_rows(const float* src, int64_t rows, int64_t row_floats, int64_t stride, float* dst) {
  for (int64_t t = 0; t < rows; ++t)
    std::memcpy(dst + t * row_floats, src + t * stride, static_cast<size_t>(row_floats) * sizeof(float));
}
void unpack_rows(const float* src, int64_t rows, int64_t row_floats, int64_t stride, float* dst) {
  for (int64_t t = 0; t < rows; ++t)
    std::memcpy(dst + t * stride, src + t * row_floats, static_cast<size_t>(row_floats) * sizeof(float));
}

// c = alpha * op(a) op(b) + beta * c, row-major, on the GEMM engine's choice for this
// machine (OpenBLAS on an SSE3 core ran this kernel 3-4x slower; docs/PERFORMANCE.md).
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm_f32_strided(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// K and V of one (batch, kv head), and in the backward its dK and dV: rows [Sk, d], `stride`
// floats apart (d when packed, n_kv * d when read in place).
struct KvHead {
  const float *k = nullptr, *v = nullptr;
  float *dk = nullptr, *dv = nullptr;
  int64_t stride = 0;
};

// ---- forward ----

// The online-softmax step of one tile (flash_attention_tiles.h), row by row.
template <bool kMasked>
void online_softmax(const Plan& p, int64_t i0, const Tile& tile) {
  const int64_t g = p.dims.group(), d = p.dims.d, ld = p.keys_per_block;
  for (int64_t t = tile.t0; t < tile.t0 + tile.tokens; ++t)
    for (int64_t r = t * g; r < (t + 1) * g; ++r)
      flash::online_softmax_row<kMasked>(p.scores + r * ld + tile.j0 % ld, p.k_pos + tile.j0,
                                         flash::key_bound(p.q_pos[i0 + t], p.dims.window), tile.keys, p.row_a[r],
                                         p.row_b[r], p.acc_rows + r * d, d);
}

void forward_tile(const Plan& p, const KvHead& kv, int64_t i0, const Tile& tile, Visibility vis) {
  const int64_t g = p.dims.group(), d = p.dims.d, ld = p.keys_per_block;
  const int64_t r0 = tile.t0 * g, rows = tile.tokens * g;
  float* scores = p.scores + r0 * ld + tile.j0 % ld;
  // S = scale * Q K^T: [rows, keys].
  gemm(false, true, rows, tile.keys, d, p.scale, p.q_rows + r0 * d, d, kv.k + tile.j0 * kv.stride, kv.stride,
       0.0f, scores, ld);
  if (vis == Visibility::kPartial) {
    online_softmax<true>(p, i0, tile);
  } else {
    online_softmax<false>(p, i0, tile);
  }
  // acc += P V: [rows, d].
  gemm(false, false, rows, d, tile.keys, 1.0f, scores, ld, kv.v + tile.j0 * kv.stride, kv.stride, 1.0f,
       p.acc_rows + r0 * d, d);
}

// out = acc / l and lse = m + log l for the rows of one q block; rows that saw no key
// (l == 0) get 0 and -inf.
void finish_q_block(const Plan& p, int64_t b, int64_t hk, int64_t i0, int64_t tokens, float* out, float* lse) {
  const int64_t g = p.dims.group(), d = p.dims.d;
  for (int64_t r = 0; r < tokens * g; ++r) {
    const float l = p.row_b[r];
    const float inv = l > 0 ? 1.0f / l : 0.0f;
    float* acc = p.acc_rows + r * d;
    for (int64_t e = 0; e < d; ++e) acc[e] *= inv;
    const int64_t h = hk * g + r % g, i = i0 + r / g;
    lse[(b * p.dims.n_h + h) * p.dims.sq + i] = l > 0 ? p.row_a[r] + std::log(l) : kNegInf;
  }
  unpack_rows(p.acc_rows, tokens, g * d, p.q_stride, out + group_offset(p, b, i0, hk));
}

template <typename Step>
void for_each_k_block(const Plan& p, int64_t i0, int64_t tokens, const Step& step) {
  const flash::BlockPositions bp{p.q_pos, p.k_pos, p.k_ranges, p.dims.sk, p.keys_per_block, p.dims.window};
  flash::for_each_k_block(bp, p.dims.group(), i0, tokens, step);
}

void forward_q_block(const Plan& p, const float* q, const KvHead& kv, int64_t b, int64_t hk, int64_t i0,
                     float* out, float* lse) {
  const int64_t tokens = std::min(p.tokens_per_q_block, p.dims.sq - i0), rows = tokens * p.dims.group();
  pack_rows(q + group_offset(p, b, i0, hk), tokens, p.dims.group() * p.dims.d, p.q_stride, p.q_rows);
  std::fill_n(p.row_a, rows, kNegInf);
  std::fill_n(p.row_b, rows, 0.0f);
  std::fill_n(p.acc_rows, rows * p.dims.d, 0.0f);
  for_each_k_block(p, i0, tokens,
                   [&](const Tile& tile, Visibility vis) { forward_tile(p, kv, i0, tile, vis); });
  finish_q_block(p, b, hk, i0, tokens, out, lse);
}

// K and V of (b, hk) for reading, packed into the workspace when their rows are strided; in
// the backward also the dK, dV accumulators, zeroed: in the workspace, or in place when
// n_kv == 1 (then the head's rows are contiguous and nothing is packed).
KvHead view_kv_head(const Plan& p, const float* k, const float* v, float* dk, float* dv, int64_t b, int64_t hk) {
  const size_t off = kv_head_offset(p, b, hk);
  const int64_t d = p.dims.d, sk = p.dims.sk;
  KvHead kv{k + off, v + off, dk ? dk + off : nullptr, dv ? dv + off : nullptr, d};
  if (p.k_head != nullptr) {
    pack_rows(k + off, sk, d, p.kv_stride, p.k_head);
    pack_rows(v + off, sk, d, p.kv_stride, p.v_head);
    kv = {p.k_head, p.v_head, p.dk_head, p.dv_head, d};
  }
  if (kv.dk != nullptr) {
    std::fill_n(kv.dk, sk * d, 0.0f);
    std::fill_n(kv.dv, sk * d, 0.0f);
  }
  return kv;
}

// ---- backward ----

struct Grads {
  const float *out, *lse, *d_out;
  float* dq;
};

// P = e^(S - lse) (0 where masked) in place on the tile's scores.
template <bool kMasked>
void probabilities(const Plan& p, int64_t i0, const Tile& tile) {
  const int64_t g = p.dims.group(), ld = p.keys_per_block;
  for (int64_t t = tile.t0; t < tile.t0 + tile.tokens; ++t)
    for (int64_t r = t * g; r < (t + 1) * g; ++r)
      flash::probabilities_row<kMasked>(p.scores + r * ld + tile.j0 % ld, p.k_pos + tile.j0,
                                        flash::key_bound(p.q_pos[i0 + t], p.dims.window), tile.keys, p.row_a[r]);
}

// dS = P * (dP - delta) in place on the tile's dP.
void score_grads(const Plan& p, const Tile& tile) {
  const int64_t g = p.dims.group(), ld = p.keys_per_block;
  for (int64_t r = tile.t0 * g; r < (tile.t0 + tile.tokens) * g; ++r)
    flash::score_grads_row(p.scores + r * ld + tile.j0 % ld, p.d_scores + r * ld + tile.j0 % ld, p.row_b[r],
                           tile.keys);
}

void backward_tile(const Plan& p, const KvHead& kv, int64_t i0, const Tile& tile, Visibility vis) {
  const int64_t g = p.dims.group(), d = p.dims.d, ld = p.keys_per_block;
  const int64_t r0 = tile.t0 * g, rows = tile.tokens * g, keys = tile.keys;
  const int64_t kv_off = tile.j0 * kv.stride, s_off = r0 * ld + tile.j0 % ld;
  const float *q = p.q_rows + r0 * d, *d_out = p.acc_rows + r0 * d;
  gemm(false, true, rows, keys, d, p.scale, q, d, kv.k + kv_off, kv.stride, 0.0f, p.scores + s_off, ld);
  if (vis == Visibility::kPartial) {
    probabilities<true>(p, i0, tile);
  } else {
    probabilities<false>(p, i0, tile);
  }
  // dV += P^T dO: [keys, d].
  gemm(true, false, keys, d, rows, 1.0f, p.scores + s_off, ld, d_out, d, 1.0f, kv.dv + kv_off, kv.stride);
  // dP = dO V^T: [rows, keys]; then dS = P * (dP - delta).
  gemm(false, true, rows, keys, d, 1.0f, d_out, d, kv.v + kv_off, kv.stride, 0.0f, p.d_scores + s_off, ld);
  score_grads(p, tile);
  // dQ += scale * dS K: [rows, d]; dK += scale * dS^T Q: [keys, d].
  gemm(false, false, rows, d, keys, p.scale, p.d_scores + s_off, ld, kv.k + kv_off, kv.stride, 1.0f,
       p.dq_rows + r0 * d, d);
  gemm(true, false, keys, d, rows, p.scale, p.d_scores + s_off, ld, q, d, 1.0f, kv.dk + kv_off, kv.stride);
}

// Packs Q and dO of the q block and, per stacked row, lse and delta = rowsum(dO * O); zeroes
// the dq accumulator.
void prepare_q_block(const Plan& p, const float* q, const Grads& gr, int64_t b, int64_t hk, int64_t i0,
                     int64_t tokens) {
  const int64_t g = p.dims.group(), d = p.dims.d;
  const size_t off = group_offset(p, b, i0, hk);
  pack_rows(q + off, tokens, g * d, p.q_stride, p.q_rows);
  pack_rows(gr.d_out + off, tokens, g * d, p.q_stride, p.acc_rows);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t r = t * g + gi;
      p.row_a[r] = gr.lse[(b * p.dims.n_h + hk * g + gi) * p.dims.sq + i0 + t];
      p.row_b[r] = flash::dot(p.acc_rows + r * d, gr.out + off + t * p.q_stride + gi * d, d);
    }
  std::fill_n(p.dq_rows, tokens * g * d, 0.0f);
}

void backward_q_block(const Plan& p, const float* q, const Grads& gr, const KvHead& kv, int64_t b, int64_t hk,
                      int64_t i0) {
  const int64_t tokens = std::min(p.tokens_per_q_block, p.dims.sq - i0);
  prepare_q_block(p, q, gr, b, hk, i0, tokens);
  for_each_k_block(p, i0, tokens,
                   [&](const Tile& tile, Visibility vis) { backward_tile(p, kv, i0, tile, vis); });
  unpack_rows(p.dq_rows, tokens, p.dims.group() * p.dims.d, p.q_stride, gr.dq + group_offset(p, b, i0, hk));
}

}  // namespace

// One scratch for both kernels, the larger need of each part: a bf16 layout's dry run (the
// meta backend allocates this whatever the dtype) then counts what either kernel takes, and a
// bf16 run that needs no widened copies takes the workspace of the f32 run.
AttentionScratch cpu_flash_attention_scratch(const AttentionDims& d, bool backward) {
  const BufferSizes b = buffer_sizes(d);
  AttentionScratch s;
  s.floats = (backward ? 3 : 2) * b.mat + (backward ? 2 : 1) * b.sc + 2 * b.vec + (backward ? 4 : 2) * b.head;
  s.range_ints = 2 * ((d.sk + keys_per_block(d) - 1) / keys_per_block(d));
  const AttentionScratch bf = flash_attention_bf16_scratch(d, backward);
  return {std::max(s.floats, bf.floats), std::max(s.range_ints, bf.range_ints)};
}

void flash_attention_forward(const AttentionDims& dims, const float* q, const float* k, const float* v,
                             const int32_t* q_pos, const int32_t* k_pos, float scale, float* out, float* lse) {
  if (dims.batch == 0 || dims.sq == 0 || dims.n_h == 0) return;
  if (dims.sk == 0) {  // no key at all: every query sees nothing
    std::fill_n(out, dims.batch * dims.sq * dims.n_h * dims.d, 0.0f);
    std::fill_n(lse, dims.batch * dims.n_h * dims.sq, kNegInf);
    return;
  }
  const Plan p = make_plan(dims, q_pos, k_pos, scale, /*backward=*/false);
  for (int64_t b = 0; b < dims.batch; ++b)
    for (int64_t hk = 0; hk < dims.n_kv; ++hk) {
      const KvHead kv = view_kv_head(p, k, v, nullptr, nullptr, b, hk);
      for (int64_t i0 = 0; i0 < dims.sq; i0 += p.tokens_per_q_block)
        forward_q_block(p, q, kv, b, hk, i0, out, lse);
    }
}

void flash_attention_backward(const AttentionDims& dims, const float* q, const float* k, const float* v,
                              const float* out, const float* lse, const float* d_out, const int32_t* q_pos,
                              const int32_t* k_pos, float scale, float* dq, float* dk, float* dv) {
  if (dims.batch == 0 || dims.sq == 0 || dims.n_h == 0 || dims.sk == 0) {
    std::fill_n(dq, dims.batch * dims.sq * dims.n_h * dims.d, 0.0f);
    std::fill_n(dk, dims.batch * dims.sk * dims.n_kv * dims.d, 0.0f);
    std::fill_n(dv, dims.batch * dims.sk * dims.n_kv * dims.d, 0.0f);
    return;
  }
  const Plan p = make_plan(dims, q_pos, k_pos, scale, /*backward=*/true);
  const Grads gr{out, lse, d_out, dq};
  for (int64_t b = 0; b < dims.batch; ++b)
    for (int64_t hk = 0; hk < dims.n_kv; ++hk) {
      const KvHead kv = view_kv_head(p, k, v, dk, dv, b, hk);
      for (int64_t i0 = 0; i0 < dims.sq; i0 += p.tokens_per_q_block)
        backward_q_block(p, q, gr, kv, b, hk, i0);
      if (p.dk_head != nullptr) {  // packed: write this head's rows back
        const size_t off = kv_head_offset(p, b, hk);
        unpack_rows(p.dk_head, dims.sk, dims.d, p.kv_stride, dk + off);
        unpack_rows(p.dv_head, dims.sk, dims.d, p.kv_stride, dv + off);
      }
    }
}

}  // namespace foldpar
