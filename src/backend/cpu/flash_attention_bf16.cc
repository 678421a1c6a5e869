// Blocked ("flash") causal attention with bf16 operands and f32 accumulation on one CPU thread:
// the tiling, visibility and softmax of the f32 kernel (flash_attention_tiles.h), with every
// tile product on oneDNN's bf16 matmul (gemm_bf16, gemm_engine.h; AVX512_BF16 or AMX
// instructions, f32 accumulation and output). Q, K, V and dO are read as bf16 (K, V packed
// per kv head when n_kv > 1); scores, softmax, lse, the row statistics and the O, dQ, dK, dV accumulators stay
// f32. P and dS are rounded to bf16 once, as operands of the next product (as FlashAttention
// and cuDNN's bf16 kernels do), by the row step that computes them (bf16_score_rows.h); the
// outputs are rounded to bf16 once at the end, as the bf16 storage decorator rounds the f32
// kernel's. Scratch: one f32 workspace carved into f32 and
// bf16 buffers plus the k blocks' position ranges, both cpu_flash_attention_scratch (the same
// for both kernels), which the dry run's meta backend allocates alike.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "backend/cpu/flash_attention.h"
#include "backend/cpu/bf16_round.h"
#include "backend/cpu/bf16_score_rows.h"
#include "backend/cpu/flash_attention_tiles.h"
#include "backend/cpu/gemm_engine.h"
#include "tensor/tensor.h"

namespace foldpar {
namespace {

using flash::kLanes;
using flash::kNegInf;
using flash::Tile;
using flash::Visibility;

// Twice the f32 kernel's key block (bench/attention_bench --bf16, a loaded machine, thread
// CPU time): oneDNN's bf16 calls cost more fixed time per call (B reordered for AMX, the
// primitive's dispatch) than sgemm's, so longer products pay. At S = 4096, fwd / bwd GFLOP/s:
// d = 64: 256 x 256 blocks not swept at this size, 512 x 512 118 / 119, 256 x 512 172 / 124;
// d = 128: 512 x 512 242 / 193, 256 x 512 259 / 211. The bf16 working set per element is half
// the f32 one, so a 256 x 512 block pair still fits in L2 (2 MiB).
constexpr int64_t kStackedRows = 256;  // rows of a q block: query tokens x GQA group
constexpr int64_t kKeyBlock = 512;     // keys of a k block

int64_t tokens_per_q_block(const AttentionDims& d) { return std::max<int64_t>(1, std::min(kStackedRows / d.group(), d.sq)); }
int64_t keys_per_block(const AttentionDims& d) { return std::max<int64_t>(1, std::min(kKeyBlock, d.sk)); }

// Buffer sizes in floats, each a whole number of 64-byte lines; a bf16 buffer of n elements
// takes n / 2 floats.
struct Sizes {
  int64_t mat, mat_bf, sc, sc_bf, vec, head, head_bf, head_t;
};
Sizes sizes_of(const AttentionDims& d) {
  auto line = [](int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; };
  const int64_t rows = tokens_per_q_block(d) * d.group(), keys = keys_per_block(d);
  return {line(rows * d.d), line((rows * d.d + 1) / 2), line(rows * keys), line((rows * keys + 1) / 2), line(rows),
          line(d.sk * d.d), d.n_kv == 1 ? 0 : line((d.sk * d.d + 1) / 2), line((d.sk * d.d + 1) / 2)};
}

// Forward: q (bf16), acc, scores, P (bf16), m, l. Backward: q, dO (bf16), dQ^T, one split
// tile's dQ^T, S^T, P^T (bf16), dP^T, dS^T (bf16), lse, delta, each row's key bounds (two
// i32 arrays), one kv head's dK, dV accumulators [Sk, d] and its K^T (bf16 [d, Sk]). Both:
// when n_kv > 1, one kv head's K and V packed contiguous in bf16 (oneDNN 2.6 runs a strided
// bf16 operand on its slow gemm:jit path instead of AMX/AVX512_BF16 brgemm, ~3x slower).
int64_t floats_needed(const AttentionDims& d, bool backward) {
  const Sizes s = sizes_of(d);
  if (!backward) return s.mat_bf + s.mat + s.sc + s.sc_bf + 2 * s.vec + 2 * s.head_bf;
  return 2 * s.mat_bf + 2 * s.mat + 2 * s.sc + 2 * s.sc_bf + 4 * s.vec + 2 * s.head + 2 * s.head_bf + s.head_t;
}

struct Plan {
  AttentionDims dims{};
  float scale = 0;
  const int32_t *q_pos = nullptr, *k_pos = nullptr;
  int64_t tokens_per_q_block = 0, keys_per_block = 0;
  int64_t q_stride = 0, kv_stride = 0;  // elements between consecutive tokens: n_h * d, n_kv * d
  Tensor workspace, k_range_storage;
  const int32_t* k_ranges = nullptr;  // (lo, hi) position range of each k block
  bf16* q_rows = nullptr;             // [rows, d]: the packed q block
  bf16* do_rows = nullptr;            // [rows, d]: the packed dO block (backward)
  float* acc_rows = nullptr;          // [rows, d]: O accumulator (forward); [d, rows]: dQ^T (backward)
  float* dq_tile = nullptr;           // [d, rows of a split tile]: its dQ^T, added into acc_rows (backward)
  // One tile's matrices, contiguous: the forward's S in f32 and P in bf16, [rows, keys]; the
  // backward's transposes S^T and dP^T in f32, P^T and dS^T in bf16, [keys, rows].
  float* scores = nullptr;
  bf16* p_bf = nullptr;
  float* d_scores = nullptr;
  bf16* ds_bf = nullptr;
  float* row_a = nullptr;  // [rows]: running max m (forward) / lse (backward)
  float* row_b = nullptr;  // [rows]: running sum l (forward) / delta = rowsum(dO * O) (backward)
  int32_t *row_lo = nullptr, *row_hi = nullptr;  // [rows]: the key positions each row sees (backward)
  bf16* kt_head = nullptr;                       // [d, Sk]: one kv head's K^T (backward)
  float *dk_acc = nullptr, *dv_acc = nullptr;  // [Sk, d] each (backward)
  bf16 *k_head = nullptr, *v_head = nullptr;   // [Sk, d] each, when n_kv > 1: K, V packed
};

Plan make_plan(const AttentionDims& d, const int32_t* q_pos, const int32_t* k_pos, float scale, bool backward) {
  FP_CHECK(d.d > 0, "flash attention bf16: head dim {} must be positive", d.d);
  Plan p;
  p.dims = d;
  p.scale = scale;
  p.q_pos = q_pos;
  p.k_pos = k_pos;
  p.tokens_per_q_block = tokens_per_q_block(d);
  p.keys_per_block = keys_per_block(d);
  p.q_stride = d.n_h * d.d;
  p.kv_stride = d.n_kv * d.d;
  const Sizes s = sizes_of(d);
  const AttentionScratch scratch = cpu_flash_attention_scratch(d, backward);
  p.workspace = Tensor::empty({scratch.floats}, DType::kF32, MemCategory::kWorkspace);
  float* w = p.workspace.data<float>();
  auto take = [&w](int64_t n) { return std::exchange(w, w + n); };
  auto take_bf = [&take](int64_t n) { return reinterpret_cast<bf16*>(take(n)); };
  p.q_rows = take_bf(s.mat_bf);
  p.acc_rows = take(s.mat);
  p.scores = take(s.sc);
  p.p_bf = take_bf(s.sc_bf);
  p.row_a = take(s.vec);
  p.row_b = take(s.vec);
  if (backward) {
    p.do_rows = take_bf(s.mat_bf);
    p.dq_tile = take(s.mat);
    p.d_scores = take(s.sc);
    p.ds_bf = take_bf(s.sc_bf);
    p.row_lo = reinterpret_cast<int32_t*>(take(s.vec));
    p.row_hi = reinterpret_cast<int32_t*>(take(s.vec));
    p.dk_acc = take(s.head);
    p.dv_acc = take(s.head);
    p.kt_head = take_bf(s.head_t);
  }
  if (s.head_bf > 0) {
    p.k_head = take_bf(s.head_bf);
    p.v_head = take_bf(s.head_bf);
  }
  const int64_t k_blocks = (d.sk + p.keys_per_block - 1) / p.keys_per_block;
  p.k_range_storage = Tensor::empty({scratch.range_ints}, DType::kI32, MemCategory::kWorkspace);
  int32_t* ranges = p.k_range_storage.data<int32_t>();
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const int64_t j0 = kb * p.keys_per_block;
    const flash::PosRange r = flash::range_of(k_pos + j0, std::min(p.keys_per_block, d.sk - j0));
    ranges[2 * kb] = r.lo;
    ranges[2 * kb + 1] = r.hi;
  }
  p.k_ranges = ranges;
  return p;
}

flash::BlockPositions block_positions(const Plan& p) {
  return {p.q_pos, p.k_pos, p.k_ranges, p.dims.sk, p.keys_per_block, p.dims.window};
}

size_t group_offset(const Plan& p, int64_t b, int64_t i0, int64_t hk) {
  return static_cast<size_t>(((b * p.dims.sq + i0) * p.dims.n_h + hk * p.dims.group()) * p.dims.d);
}
size_t kv_head_offset(const Plan& p, int64_t b, int64_t hk) {
  return static_cast<size_t>((b * p.dims.sk * p.dims.n_kv + hk) * p.dims.d);
}

void pack_rows(const bf16* src, int64_t rows, int64_t row_elems, int64_t stride, bf16* dst) {
  for (int64_t t = 0; t < rows; ++t)
    std::memcpy(dst + t * row_elems, src + t * stride, static_cast<size_t>(row_elems) * sizeof(bf16));
}
// f32 rows rounded to bf16 (to nearest even) into rows `stride` elements apart.
void round_rows(const float* src, int64_t rows, int64_t row_elems, int64_t stride, bf16* dst) {
  for (int64_t t = 0; t < rows; ++t) round_run_to_bf16(src + t * row_elems, row_elems, dst + t * stride);
}

// dst [cols, rows] = src^T, src [rows, cols] with rows `stride` elements apart. In blocks of
// 32 rows, so each destination row gets a whole 64-byte line at a time: element by element,
// the writes Sk elements apart all fell in one L1 set and the transpose of K took a tenth of
// the backward.
void transpose(const bf16* src, int64_t rows, int64_t cols, int64_t stride, bf16* dst) {
  constexpr int64_t kBlock = 32;
  for (int64_t j0 = 0; j0 < rows; j0 += kBlock) {
    const int64_t n = std::min(kBlock, rows - j0);
    for (int64_t e = 0; e < cols; ++e)
      for (int64_t j = j0; j < j0 + n; ++j) dst[e * rows + j] = src[j * stride + e];
  }
}

float load(const float* x, int64_t i) { return x[i]; }
float load(const bf16* x, int64_t i) { return bf16_to_f32(x[i]); }
void store(float v, float* x, int64_t i) { x[i] = v; }
void store(float v, bf16* x, int64_t i) { x[i] = f32_to_bf16(v); }

// c [m, n] f32 contiguous = alpha op(a) op(b) + beta c; a, b bf16 with leading dims lda, ldb.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const bf16* a, int64_t lda,
          const bf16* b, int64_t ldb, float beta, float* c) {
  gemm_bf16(MatmulDims{m, n, k, lda, ldb}, ta, tb, a, b, DType::kF32, c, alpha, beta);
}

// K and V of one (batch, kv head): rows [Sk, d], `stride` elements apart (in place when
// n_kv == 1, packed otherwise, stride d either way).
struct KvHead {
  const bf16 *k, *v;
  int64_t stride;
};

KvHead view_kv_head(const Plan& p, const FlashBf16Inputs& in, int64_t b, int64_t hk) {
  const size_t off = kv_head_offset(p, b, hk);
  if (p.k_head == nullptr) return {in.k + off, in.v + off, p.kv_stride};
  pack_rows(in.k + off, p.dims.sk, p.dims.d, p.kv_stride, p.k_head);
  pack_rows(in.v + off, p.dims.sk, p.dims.d, p.kv_stride, p.v_head);
  return {p.k_head, p.v_head, p.dims.d};
}

// ---- forward ----

void forward_tile(const Plan& p, const KvHead& kv, int64_t i0, const Tile& tile, Visibility vis) {
  const int64_t g = p.dims.group(), d = p.dims.d, keys = tile.keys;
  const int64_t r0 = tile.t0 * g, rows = tile.tokens * g, kv_off = tile.j0 * kv.stride;
  // S = scale * Q K^T: [rows, keys].
  gemm(false, true, rows, keys, d, p.scale, p.q_rows + r0 * d, d, kv.k + kv_off, kv.stride, 0.0f, p.scores);
  for (int64_t t = tile.t0; t < tile.t0 + tile.tokens; ++t)
    for (int64_t r = t * g; r < (t + 1) * g; ++r) {
      float* s = p.scores + (r - r0) * keys;
      float* acc = p.acc_rows + r * d;
      const flash::KeyBound bound = flash::key_bound(p.q_pos[i0 + t], p.dims.window);
      // P goes straight to its bf16 row; the f32 P is not kept.
      bf16* p_row = p.p_bf + (r - r0) * keys;
      auto exp_sum = [s, keys, p_row](float shift) { return flash::exp_sum_round(s, shift, keys, p_row); };
      if (vis == Visibility::kPartial) {
        flash::online_softmax_row<true>(s, p.k_pos + tile.j0, bound, keys, p.row_a[r], p.row_b[r], acc, d, exp_sum);
      } else {
        flash::online_softmax_row<false>(s, p.k_pos + tile.j0, bound, keys, p.row_a[r], p.row_b[r], acc, d, exp_sum);
      }
    }
  // acc += P V: [rows, d].
  gemm(false, false, rows, d, keys, 1.0f, p.p_bf, keys, kv.v + kv_off, kv.stride, 1.0f, p.acc_rows + r0 * d);
}

template <typename LseT>
void forward_q_block(const Plan& p, const bf16* q, const KvHead& kv, int64_t b, int64_t hk, int64_t i0, bf16* out,
                     LseT* lse) {
  const int64_t g = p.dims.group(), d = p.dims.d;
  const int64_t tokens = std::min(p.tokens_per_q_block, p.dims.sq - i0), rows = tokens * g;
  const size_t off = group_offset(p, b, i0, hk);
  pack_rows(q + off, tokens, g * d, p.q_stride, p.q_rows);
  std::fill_n(p.row_a, rows, kNegInf);
  std::fill_n(p.row_b, rows, 0.0f);
  std::fill_n(p.acc_rows, rows * d, 0.0f);
  flash::for_each_k_block(block_positions(p), g, i0, tokens,
                          [&](const Tile& tile, Visibility vis) { forward_tile(p, kv, i0, tile, vis); });
  // out = acc / l, lse = m + log l; rows that saw no key (l == 0) get 0 and -inf.
  for (int64_t r = 0; r < rows; ++r) {
    const float l = p.row_b[r], inv = l > 0 ? 1.0f / l : 0.0f;
    float* acc = p.acc_rows + r * d;
    for (int64_t e = 0; e < d; ++e) acc[e] *= inv;
    const int64_t h = hk * g + r % g, i = i0 + r / g;
    store(l > 0 ? p.row_a[r] + std::log(l) : kNegInf, lse, (b * p.dims.n_h + h) * p.dims.sq + i);
  }
  round_rows(p.acc_rows, tokens, g * d, p.q_stride, out + off);
}

// ---- backward ----

template <typename LseT>
struct Grads {
  const bf16 *out, *d_out;
  const LseT* lse;
  bf16* dq;
};

// The backward runs transposed ([keys, rows] tiles): oneDNN 2.6's bf16 matmul copies a
// transposed A before its kernel, which made dV += P^T dO and dK += dS^T Q about 35% slower
// than the untransposed products of the same shape (283 against 205 Mcycles of 1336 in the
// S = 4096, d = 64 attention_bench). With S^T and dP^T computed instead of S and dP, P^T and
// dS^T are stored as the products read them, and dQ is accumulated as dQ^T = K^T dS^T from
// K^T packed once per kv head: no product takes a transposed A.
template <bool kMasked>
void tile_probabilities_and_grads(const Plan& p, int64_t r0, int64_t rows, const Tile& tile) {
  for (int64_t j = 0; j < tile.keys; ++j) {
    const int64_t at = j * rows;
    flash::key_probabilities_and_grads_round<kMasked>(p.scores + at, p.d_scores + at, p.k_pos[tile.j0 + j],
                                                      p.row_lo + r0, p.row_hi + r0, rows, p.row_a + r0,
                                                      p.row_b + r0, p.p_bf + at, p.ds_bf + at);
  }
}

// One tile of a q block of `block_rows` rows (tile.t0 onwards of it).
void backward_tile(const Plan& p, const KvHead& kv, int64_t block_rows, const Tile& tile, Visibility vis) {
  const int64_t g = p.dims.group(), d = p.dims.d, keys = tile.keys;
  const int64_t r0 = tile.t0 * g, rows = tile.tokens * g, kv_off = tile.j0 * kv.stride;
  const bf16 *q = p.q_rows + r0 * d, *d_out = p.do_rows + r0 * d;
  // S^T = scale * K Q^T and dP^T = V dO^T: [keys, rows] each; then P^T and dS^T (from the
  // f32 P) in one pass over both, straight to bf16.
  gemm(false, true, keys, rows, d, p.scale, kv.k + kv_off, kv.stride, q, d, 0.0f, p.scores);
  gemm(false, true, keys, rows, d, 1.0f, kv.v + kv_off, kv.stride, d_out, d, 0.0f, p.d_scores);
  if (vis == Visibility::kPartial) {
    tile_probabilities_and_grads<true>(p, r0, rows, tile);
  } else {
    tile_probabilities_and_grads<false>(p, r0, rows, tile);
  }
  // dV += P^T dO and dK += scale * dS^T Q: [keys, d].
  gemm(false, false, keys, d, rows, 1.0f, p.p_bf, rows, d_out, d, 1.0f, p.dv_acc + tile.j0 * d);
  gemm(false, false, keys, d, rows, p.scale, p.ds_bf, rows, q, d, 1.0f, p.dk_acc + tile.j0 * d);
  // dQ^T += scale * K^T dS^T: [d, rows], straight into the block's accumulator when the tile
  // has all its rows, else through dq_tile (a split tile's columns are not contiguous there).
  const bf16* kt = p.kt_head + tile.j0;
  if (rows == block_rows) {
    gemm(false, false, d, rows, keys, p.scale, kt, p.dims.sk, p.ds_bf, rows, 1.0f, p.acc_rows);
    return;
  }
  gemm(false, false, d, rows, keys, p.scale, kt, p.dims.sk, p.ds_bf, rows, 0.0f, p.dq_tile);
  for (int64_t e = 0; e < d; ++e)
    for (int64_t r = 0; r < rows; ++r) p.acc_rows[e * block_rows + r0 + r] += p.dq_tile[e * rows + r];
}

template <typename LseT>
void backward_q_block(const Plan& p, const bf16* q, const Grads<LseT>& gr, const KvHead& kv, int64_t b, int64_t hk,
                      int64_t i0) {
  const int64_t g = p.dims.group(), d = p.dims.d;
  const int64_t tokens = std::min(p.tokens_per_q_block, p.dims.sq - i0), rows = tokens * g;
  const size_t off = group_offset(p, b, i0, hk);
  pack_rows(q + off, tokens, g * d, p.q_stride, p.q_rows);
  pack_rows(gr.d_out + off, tokens, g * d, p.q_stride, p.do_rows);
  for (int64_t t = 0; t < tokens; ++t) {
    const flash::KeyBound bound = flash::key_bound(p.q_pos[i0 + t], p.dims.window);
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t r = t * g + gi;
      p.row_a[r] = load(gr.lse, (b * p.dims.n_h + hk * g + gi) * p.dims.sq + i0 + t);
      p.row_b[r] = flash::dot(gr.out + off + t * p.q_stride + gi * d, p.do_rows + r * d, d);
      p.row_lo[r] = bound.lo;
      p.row_hi[r] = bound.hi;
    }
  }
  std::fill_n(p.acc_rows, rows * d, 0.0f);
  flash::for_each_k_block(block_positions(p), g, i0, tokens,
                          [&](const Tile& tile, Visibility vis) { backward_tile(p, kv, rows, tile, vis); });
  // dQ^T [d, rows] to the rows of dq, rounded.
  for (int64_t r = 0; r < rows; ++r) {
    bf16* dst = gr.dq + off + (r / g) * p.q_stride + (r % g) * d;
    for (int64_t e = 0; e < d; ++e) dst[e] = f32_to_bf16(p.acc_rows[e * rows + r]);
  }
}

template <typename LseT>
void forward_all(const AttentionDims& dims, const FlashBf16Inputs& in, float scale, bf16* out, LseT* lse) {
  const int64_t n_out = dims.batch * dims.sq * dims.n_h * dims.d;
  if (dims.batch == 0 || dims.sq == 0 || dims.n_h == 0) return;
  if (dims.sk == 0) {  // no key at all: every query sees nothing
    std::fill_n(out, n_out, f32_to_bf16(0.0f));
    for (int64_t i = 0; i < dims.batch * dims.n_h * dims.sq; ++i) store(kNegInf, lse, i);
    return;
  }
  const Plan p = make_plan(dims, in.q_pos, in.k_pos, scale, /*backward=*/false);
  for (int64_t b = 0; b < dims.batch; ++b)
    for (int64_t hk = 0; hk < dims.n_kv; ++hk) {
      const KvHead kv = view_kv_head(p, in, b, hk);
      for (int64_t i0 = 0; i0 < dims.sq; i0 += p.tokens_per_q_block) forward_q_block(p, in.q, kv, b, hk, i0, out, lse);
    }
}

template <typename LseT>
void backward_all(const AttentionDims& dims, const FlashBf16Inputs& in, const bf16* out, const LseT* lse,
                  const bf16* d_out, float scale, bf16* dq, bf16* dk, bf16* dv) {
  const int64_t n_q = dims.batch * dims.sq * dims.n_h * dims.d, n_kv = dims.batch * dims.sk * dims.n_kv * dims.d;
  if (dims.batch == 0 || dims.sq == 0 || dims.n_h == 0 || dims.sk == 0) {
    std::fill_n(dq, n_q, f32_to_bf16(0.0f));
    std::fill_n(dk, n_kv, f32_to_bf16(0.0f));
    std::fill_n(dv, n_kv, f32_to_bf16(0.0f));
    return;
  }
  const Plan p = make_plan(dims, in.q_pos, in.k_pos, scale, /*backward=*/true);
  const Grads<LseT> gr{out, d_out, lse, dq};
  const int64_t head = dims.sk * dims.d;
  for (int64_t b = 0; b < dims.batch; ++b)
    for (int64_t hk = 0; hk < dims.n_kv; ++hk) {
      const size_t off = kv_head_offset(p, b, hk);
      const KvHead kv = view_kv_head(p, in, b, hk);
      transpose(kv.k, dims.sk, dims.d, kv.stride, p.kt_head);
      std::fill_n(p.dk_acc, head, 0.0f);
      std::fill_n(p.dv_acc, head, 0.0f);
      for (int64_t i0 = 0; i0 < dims.sq; i0 += p.tokens_per_q_block) backward_q_block(p, in.q, gr, kv, b, hk, i0);
      round_rows(p.dk_acc, dims.sk, dims.d, p.kv_stride, dk + off);
      round_rows(p.dv_acc, dims.sk, dims.d, p.kv_stride, dv + off);
    }
}

}  // namespace

AttentionScratch flash_attention_bf16_scratch(const AttentionDims& d, bool backward) {
  return {floats_needed(d, backward), 2 * ((d.sk + keys_per_block(d) - 1) / keys_per_block(d))};
}

void flash_attention_forward_bf16(const AttentionDims& dims, const FlashBf16Inputs& in, float scale, bf16* out,
                                  float* lse) {
  forward_all(dims, in, scale, out, lse);
}
void flash_attention_forward_bf16(const AttentionDims& dims, const FlashBf16Inputs& in, float scale, bf16* out,
                                  bf16* lse) {
  forward_all(dims, in, scale, out, lse);
}

void flash_attention_backward_bf16(const AttentionDims& dims, const FlashBf16Inputs& in, const bf16* out,
                                   const float* lse, const bf16* d_out, float scale, bf16* dq, bf16* dk, bf16* dv) {
  backward_all(dims, in, out, lse, d_out, scale, dq, dk, dv);
}
void flash_attention_backward_bf16(const AttentionDims& dims, const FlashBf16Inputs& in, const bf16* out,
                                   const bf16* lse, const bf16* d_out, float scale, bf16* dq, bf16* dk, bf16* dv) {
  backward_all(dims, in, out, lse, d_out, scale, dq, dk, dv);
}

}  // namespace foldpar
