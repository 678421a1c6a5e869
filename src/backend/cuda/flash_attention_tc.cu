// Causal flash attention on tensor cores (FlashAttention-2 style) for bf16 storage, head dims
// 64 and 128: bf16 mma.sync m16n8k16 with f32 accumulation, the online softmax in f32 in
// registers, K/V (forward, dQ) or Q/dO (dK/dV) tiles double-buffered in shared memory with
// cp.async. Same contract as flash_attention.cu (the plain reference kept beside it): key j
// visible to query i iff k_pos[j] <= q_pos[i] (and q_pos[i] - k_pos[j] < W under a sliding
// window W), GQA, lse = natural log of the softmax denominator of the scaled scores, a row
// that sees no key gives out = 0, lse = -inf, dq = 0.
// Not here: f32 storage, other head dims (attention_tc_supported), WGMMA/TMA (sm_90 only).
// One file because the three kernels share the fragment helpers and tile machinery below.
#include <climits>
#include <cstring>

#include "backend/cuda/cuda_common.cuh"

namespace foldpar::cuda {
namespace {

using nv_bf16 = __nv_bfloat16;

// ---- mma.sync / ldmatrix / cp.async ------------------------------------------------------
// Fragment layouts of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX ISA, "Matrix
// fragments for mma.m16n8k16 with floating point type"), g = lane / 4, t = lane % 4; a b32
// register holds two bf16, the lower column (or k) index in the low 16 bits:
//   A 16x16 [m][k]: a[0] = A[g][2t, 2t+1]    a[1] = A[g+8][2t, 2t+1]
//                   a[2] = A[g][2t+8, 2t+9]  a[3] = A[g+8][2t+8, 2t+9]
//   B 16x8  [k][n]: b[0] = B[2t, 2t+1][g]    b[1] = B[2t+8, 2t+9][g]
//   C 16x8  [m][n]: c[0], c[1] = C[g][2t, 2t+1]    c[2], c[3] = C[g+8][2t, 2t+1]
// Consequence used by every P @ V style product: the C fragments of two adjacent n-tiles
// (columns 16kk..16kk+7 and 16kk+8..16kk+15) are, packed to bf16 in the order
// {c0[0..1], c0[2..3], c1[0..1], c1[2..3]}, exactly the A fragment of the 16x16 block of
// columns 16kk..16kk+15 (pack_a below).
// ldmatrix.x4: lane i gives the address of row i % 8 of 8x8 matrix i / 8 (16 contiguous
// bytes); register r of lane l receives matrix r's [l / 4][2 (l % 4), +1] (plain), or
// [2 (l % 4), +1][l / 4] (.trans).
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const nv_bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const nv_bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  return u;
}
// The A fragment of C columns 16kk..16kk+15 from the C fragments of its two n-tiles.
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// Shared-memory tiles are [rows][D + kPad] bf16: the pad makes the row stride 16 bytes more
// than a multiple of 128, so the 8 row addresses of one ldmatrix matrix fall in distinct
// bank groups (no conflicts), and keeps every row 16-byte aligned (D % 8 == 0).
constexpr int kPad = 8;
constexpr int kTileRows = 64;  // rows of a K/V or Q/dO tile; the tile bounds' granularity
constexpr int kFwdRows = 128;  // query rows of a forward CTA: 8 warps x 16
constexpr int kFwdThreads = 256;
constexpr int kBwdThreads = 128;  // backward CTAs: 64 rows, 4 warps x 16
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// Element offset, in a [rows][stride] tile, of this lane's ldmatrix row address for the
// 16x16 block at (row0, col0), matrices in A order: (rows 0-7, cols 0-7), (8-15, 0-7),
// (0-7, 8-15), (8-15, 8-15). Plain: the A fragment of the block. .trans on a [k][n] block:
// r0, r1 = b0, b1 of the n-tile of cols 0-7, r2, r3 = b0, b1 of the n-tile of cols 8-15.
__device__ __forceinline__ int offset_a_order(int row0, int col0, int stride) {
  const int lane = threadIdx.x & 31;
  return (row0 + ((lane >> 3) & 1) * 8 + (lane & 7)) * stride + col0 + (lane >> 4) * 8;
}
// Same, matrices in B-pair order: (rows 0-7, cols 0-7), (0-7, 8-15), (8-15, 0-7), (8-15,
// 8-15). Plain on an [n][k] block (B = its transpose): r0, r1 = b0, b1 of the n-tile of rows
// 0-7, r2, r3 = b0, b1 of the n-tile of rows 8-15.
__device__ __forceinline__ int offset_b_order(int row0, int col0, int stride) {
  const int lane = threadIdx.x & 31;
  return (row0 + (lane >> 4) * 8 + (lane & 7)) * stride + col0 + ((lane >> 3) & 1) * 8;
}

// Starts copying rows [row0, row0 + kTileRows) of head `head` of a [B, seq, heads, D] bf16
// tensor into a [kTileRows][D + kPad] tile; rows past seq are zeroed (a NaN there would
// survive a zero probability: 0 * NaN).
template <int D, int kThreads>
__device__ void load_tile(const nv_bf16* src, int64_t b, int64_t row0, int64_t seq, int64_t heads, int64_t head,
                          int rows, nv_bf16* dst) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int idx = threadIdx.x; idx < rows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    nv_bf16* to = dst + r * (D + kPad) + c * 8;
    const int64_t row = row0 + r;
    if (row < seq) {
      cp_async_16(to, src + ((b * seq + row) * heads + head) * D + c * 8);
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
    }
  }
}

// The first index in [from, n) whose tile is visible, or n. Every warp runs it on the same
// data and gets the same answer, so loops driven by it are uniform across the block.
template <typename Visible>
__device__ int next_visible(int from, int n, Visible visible) {
  const int lane = threadIdx.x & 31;
  for (int base = from; base < n; base += 32) {
    const unsigned mask = __ballot_sync(0xffffffffu, base + lane < n && visible(base + lane));
    if (mask != 0) return base + __ffs(static_cast<int>(mask)) - 1;
  }
  return n;
}

// Reductions across the 4 lanes (t = 0..3) that hold one row of a C fragment.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Stores C-fragment rows (g, g + 8) of a warp's 16 x D accumulator, times row_scale[h],
// as bf16 rows row0 + g + 8h (those < seq) of head `head` of a [B, seq, heads, D] tensor.
template <int D>
__device__ void store_rows(const float (&acc)[D / 8][4], const float (&row_scale)[2], nv_bf16* dst, int64_t b,
                           int64_t row0, int64_t seq, int64_t heads, int64_t head) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + g + 8 * h;
    if (row >= seq) continue;
    nv_bf16* out = dst + ((b * seq + row) * heads + head) * D + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const uint32_t v = pack_bf16(acc[n][2 * h] * row_scale[h], acc[n][2 * h + 1] * row_scale[h]);
      memcpy(out + 8 * n, &v, sizeof(v));
    }
  }
}

struct TcArgs {
  AttentionShape s;
  const nv_bf16 *q, *k, *v, *out, *d_out;
  const int32_t *q_pos, *k_pos;
  // (min, max) position over the valid rows of each 64-row tile: the query tiles, then the
  // key tiles (tile_bounds_kernel).
  const int2* bounds;
  const float* lse_in;  // backward: the forward's lse [B, n_h, Sq]
  const float* delta;   // backward: rowsum(dO * O) [B, n_h, Sq]
  nv_bf16 *o, *dq, *dk, *dv;
  float* lse;  // forward's output
  __device__ int q_tiles() const { return static_cast<int>((s.sq + kTileRows - 1) / kTileRows); }
  __device__ int k_tiles() const { return static_cast<int>((s.sk + kTileRows - 1) / kTileRows); }
  __device__ const int2* q_bounds() const { return bounds; }
  __device__ const int2* k_bounds() const { return bounds + q_tiles(); }
  // lse in log2 units for exp2f(score * scale * log2e - lse2): -inf (no visible key) becomes
  // +inf, so that every probability of that row is exp2f(-inf) = 0 and never NaN.
  __device__ float lse2(int64_t hq, int64_t b, int64_t row) const {
    if (row >= s.sq) return INFINITY;
    const float l = lse_in[(b * s.n_h + hq) * s.sq + row];
    return l == -INFINITY ? INFINITY : l * kLog2e;
  }
};

// One warp per tile: bounds[w] = (min, max) of the positions of the valid rows of tile w.
__global__ void tile_bounds_kernel(const int32_t* q_pos, int64_t sq, const int32_t* k_pos, int64_t sk, int n_q_tiles,
                                   int n_k_tiles, int2* bounds) {
  const int w = static_cast<int>((blockIdx.x * int64_t{blockDim.x} + threadIdx.x) >> 5), lane = threadIdx.x & 31;
  if (w >= n_q_tiles + n_k_tiles) return;  // whole warps
  const bool is_q = w < n_q_tiles;
  const int32_t* pos = is_q ? q_pos : k_pos;
  const int64_t seq = is_q ? sq : sk, row0 = int64_t{is_q ? w : w - n_q_tiles} * kTileRows;
  int lo = INT_MAX, hi = INT_MIN;
  for (int64_t row = row0 + lane; row < row0 + kTileRows && row < seq; row += 32) {
    lo = min(lo, pos[row]);
    hi = max(hi, pos[row]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  if (lane == 0) bounds[w] = make_int2(lo, hi);
}

// ---- forward -----------------------------------------------------------------------------
// grid (ceil(Sq / 128), n_h, B), 256 threads; blockIdx.x counts query blocks from the last
// (the causal ones with most keys start first). Warp w owns query rows 16w..16w+15 of the
// block; lane (g, t) holds rows g and g + 8 of those, score columns 8j + 2t, +1 of the key
// tile (j = 0..7) and output columns 8n + 2t, +1 (n = 0..D/8-1).
// smem (bf16): Q [128][D+8], K [2][64][D+8], V [2][64][D+8]: 104,448 bytes for D = 128.
template <int D>
struct FwdSmem {
  static constexpr int kStride = D + kPad;
  static constexpr int kTile = kTileRows * kStride;
  static constexpr int kQ = 0, kK = kFwdRows * kStride, kV = kK + 2 * kTile;
  static constexpr size_t kBytes = sizeof(nv_bf16) * (kV + 2 * kTile);
};

template <int D>
__global__ void __launch_bounds__(kFwdThreads, 1) attention_forward_tc_kernel(TcArgs a) {
  using L = FwdSmem<D>;
  constexpr int kS = L::kStride;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  nv_bf16* smem = reinterpret_cast<nv_bf16*>(smem_bytes);
  const AttentionShape& s = a.s;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int block = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int64_t b = blockIdx.z, hq = blockIdx.y, hk = hq / (s.n_h / s.n_kv), q0 = int64_t{block} * kFwdRows;
  const int n_k = a.k_tiles();
  const int2* kb = a.k_bounds();
  int q_min = INT_MAX, q_max = INT_MIN;  // over the valid rows of the block: its 1 or 2 tiles
  for (int qt = block * (kFwdRows / kTileRows); qt < min(a.q_tiles(), (block + 1) * (kFwdRows / kTileRows)); ++qt) {
    q_min = min(q_min, a.q_bounds()[qt].x);
    q_max = max(q_max, a.q_bounds()[qt].y);
  }
  auto visible = [&](int kt) { return kb[kt].x <= q_max && !behind_window(q_min, kb[kt].y, s.window); };
  auto load_kv = [&](int kt, int stage) {
    const int64_t k0 = int64_t{kt} * kTileRows;
    load_tile<D, kFwdThreads>(a.k, b, k0, s.sk, s.n_kv, hk, kTileRows, smem + L::kK + stage * L::kTile);
    load_tile<D, kFwdThreads>(a.v, b, k0, s.sk, s.n_kv, hk, kTileRows, smem + L::kV + stage * L::kTile);
  };

  load_tile<D, kFwdThreads>(a.q, b, q0, s.sq, s.n_h, hq, kFwdRows, smem + L::kQ);
  int kt = next_visible(0, n_k, visible);
  if (kt < n_k) load_kv(kt, 0);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  uint32_t qf[D / 16][4];  // A fragments of the warp's 16 x D block of Q
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) ldmatrix_x4(qf[kc], smem + L::kQ + offset_a_order(16 * warp, 16 * kc, kS));

  int qp[2];  // positions of rows g, g + 8; INT_MIN past Sq (sees nothing; never stored)
  for (int h = 0; h < 2; ++h) {
    const int64_t row = q0 + 16 * warp + g + 8 * h;
    qp[h] = row < s.sq ? a.q_pos[row] : INT_MIN;
  }
  // Online softmax state of rows g, g + 8, in log2 units of the scaled scores: m is the
  // running max of score * scale * log2e, l this lane's share of the running sum of
  // exp2(x - m) (the full sum is quad_sum(l), taken once at the end).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0, 0};
  float o[D / 8][4] = {};
  const float c = s.scale * kLog2e;
  int stage = 0;
  while (kt < n_k) {
    const int next = next_visible(kt + 1, n_k, visible);
    cp_async_wait_all();
    __syncthreads();  // tile kt landed for every thread; nobody still reads stage ^ 1
    if (next < n_k) load_kv(next, stage ^ 1);
    cp_async_commit();
    const int64_t k0 = int64_t{kt} * kTileRows;
    // uniform: some key ahead of a query, past Sk, or behind a query's window
    const bool masked = kb[kt].y > q_min || k0 + kTileRows > s.sk || behind_window(q_max, kb[kt].x, s.window);
    const nv_bf16* ks = smem + L::kK + stage * L::kTile;
    const nv_bf16* vs = smem + L::kV + stage * L::kTile;

    float sc[8][4] = {};  // S = Q K^T: 16 rows x 64 keys
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        uint32_t kf[4];
        ldmatrix_x4(kf, ks + offset_b_order(16 * jp, 16 * kc, kS));
        mma_16816(sc[2 * jp], qf[kc], kf[0], kf[1]);
        mma_16816(sc[2 * jp + 1], qf[kc], kf[2], kf[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t key = k0 + 8 * j + 2 * t + e;
        const int kpos = masked && key < s.sk ? a.k_pos[key] : INT_MIN;
        for (int h = 0; h < 2; ++h) {
          const bool vis = !masked || (key < s.sk && sees(qp[h], kpos, s.window));
          sc[j][2 * h + e] = vis ? sc[j][2 * h + e] * c : -INFINITY;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m[h];
#pragma unroll
      for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(sc[j][2 * h], sc[j][2 * h + 1]));
      mx = quad_max(mx);
      // A row that has seen only masked scores keeps m = -inf: subtract 0 instead, so that
      // every p is exp2f(-inf) = 0 and alpha multiplies zeros (no -inf - -inf = NaN).
      const float base = mx == -INFINITY ? 0.0f : mx;
      const float alpha = exp2f(m[h] - base);
      m[h] = mx;
      float sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        sc[j][2 * h] = exp2f(sc[j][2 * h] - base);
        sc[j][2 * h + 1] = exp2f(sc[j][2 * h + 1] - base);
        sum += sc[j][2 * h] + sc[j][2 * h + 1];
      }
      l[h] = l[h] * alpha + sum;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][2 * h] *= alpha;
        o[n][2 * h + 1] *= alpha;
      }
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // O += P V over keys 16kk..16kk+15
      uint32_t pf[4];
      pack_a(pf, sc[2 * kk], sc[2 * kk + 1]);
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, vs + offset_a_order(16 * kk, 16 * np, kS));
        mma_16816(o[2 * np], pf, vf[0], vf[1]);
        mma_16816(o[2 * np + 1], pf, vf[2], vf[3]);
      }
    }
    kt = next;
    stage ^= 1;
  }
  cp_async_wait_all();  // no copy outlives the block (none pending unless no tile was visible)

  float inv[2];
  for (int h = 0; h < 2; ++h) {
    l[h] = quad_sum(l[h]);
    inv[h] = l[h] > 0 ? 1.0f / l[h] : 0.0f;  // l >= 1 when the row saw a key (its max gives 1)
  }
  store_rows<D>(o, inv, a.o, b, q0 + 16 * warp, s.sq, s.n_h, hq);
  if (t == 0) {
    for (int h = 0; h < 2; ++h) {
      const int64_t row = q0 + 16 * warp + g + 8 * h;
      if (row < s.sq) a.lse[(b * s.n_h + hq) * s.sq + row] = l[h] > 0 ? (m[h] + log2f(l[h])) * kLn2 : -INFINITY;
    }
  }
}

// ---- backward ----------------------------------------------------------------------------
// delta[b, h, i] = sum_e dO[b, i, h, e] * O[b, i, h, e]; one warp per row (i fastest).
__global__ void attention_delta_tc_kernel(AttentionShape s, const nv_bf16* out, const nv_bf16* d_out, float* delta) {
  const int64_t w = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= s.batch * s.n_h * s.sq) return;
  const int64_t i = w % s.sq, hq = (w / s.sq) % s.n_h, b = w / (s.sq * s.n_h);
  const int64_t base = ((b * s.sq + i) * s.n_h + hq) * s.d;
  float acc = 0;
  for (int64_t e = 2 * lane; e < s.d; e += 64) {
    const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(out + base + e));
    const float2 d = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(d_out + base + e));
    acc += o.x * d.x + o.y * d.y;
  }
  acc = warp_sum(acc);
  if (lane == 0) delta[w] = acc;
}

// dK/dV: grid (ceil(Sk / 64), n_kv, B), 128 threads. Warp w owns keys 16w..16w+15 of the
// CTA's 64; lane (g, t) holds key rows g, g + 8. The CTA walks the visible 64-query tiles of
// every head of its GQA group (index it = head_in_group * q_tiles + tile), Q/dO double-
// buffered, and per 32-query half computes S^T = K Q^T and dP^T = V dO^T (16 x 32 per warp),
// P^T = exp2(S^T c - lse2), dS^T = P^T (dP^T - delta) scale, then dV += P^T dO, dK += dS^T Q.
// smem (bf16): K, V [64][D+8], Q, dO [2][64][D+8]; f32 lse2, delta and i32 q_pos [2][64]:
// 105,984 bytes for D = 128 (two CTAs per SM).
template <int D>
struct BwdSmem {
  static constexpr int kStride = D + kPad;
  static constexpr int kTile = kTileRows * kStride;
  // dK/dV: kA = K, kB = V (one tile each), kC = Q, kD = dO (two stages each).
  // dQ:    kA = Q, kB = dO (one tile each),  kC = K, kD = V  (two stages each).
  static constexpr int kA = 0, kB = kTile, kC = 2 * kTile, kD = 4 * kTile, kElems = 6 * kTile;
  static constexpr size_t kRowStats = sizeof(nv_bf16) * kElems;  // f32 [2][64] x 2, i32 [2][64]
  static constexpr size_t kBytes = kRowStats + 3 * 2 * kTileRows * sizeof(float);
};

template <int D>
__global__ void __launch_bounds__(kBwdThreads, 2) attention_dkdv_tc_kernel(TcArgs a) {
  using L = BwdSmem<D>;
  constexpr int kS = L::kStride;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  nv_bf16* smem = reinterpret_cast<nv_bf16*>(smem_bytes);
  float* lse2_s = reinterpret_cast<float*>(smem_bytes + L::kRowStats);  // [2][64]
  float* delta_s = lse2_s + 2 * kTileRows;                               // [2][64]
  int* qpos_s = reinterpret_cast<int*>(delta_s + 2 * kTileRows);         // [2][64]
  const AttentionShape& s = a.s;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t b = blockIdx.z, hk = blockIdx.y, group = s.n_h / s.n_kv, k0 = int64_t{blockIdx.x} * kTileRows;
  const int n_q = a.q_tiles(), n_iter = static_cast<int>(group) * n_q;
  const int2 kbound = a.k_bounds()[blockIdx.x];
  const int2* qb = a.q_bounds();
  auto visible = [&](int it) { return qb[it % n_q].y >= kbound.x && !behind_window(qb[it % n_q].x, kbound.y, s.window); };
  auto load_q = [&](int it, int stage) {
    const int64_t hq = hk * group + it / n_q, q0 = int64_t{it % n_q} * kTileRows;
    load_tile<D, kBwdThreads>(a.q, b, q0, s.sq, s.n_h, hq, kTileRows, smem + L::kC + stage * L::kTile);
    load_tile<D, kBwdThreads>(a.d_out, b, q0, s.sq, s.n_h, hq, kTileRows, smem + L::kD + stage * L::kTile);
    if (threadIdx.x < kTileRows) {
      const int64_t row = q0 + threadIdx.x;
      lse2_s[stage * kTileRows + threadIdx.x] = a.lse2(hq, b, row);
      delta_s[stage * kTileRows + threadIdx.x] = row < s.sq ? a.delta[(b * s.n_h + hq) * s.sq + row] : 0.0f;
      qpos_s[stage * kTileRows + threadIdx.x] = row < s.sq ? a.q_pos[row] : INT_MIN;
    }
  };

  load_tile<D, kBwdThreads>(a.k, b, k0, s.sk, s.n_kv, hk, kTileRows, smem + L::kA);
  load_tile<D, kBwdThreads>(a.v, b, k0, s.sk, s.n_kv, hk, kTileRows, smem + L::kB);
  int it = next_visible(0, n_iter, visible);
  if (it < n_iter) load_q(it, 0);
  cp_async_commit();
  bool key_ok[2];  // rows g, g + 8 of the warp's keys
  int kpos[2];
  for (int h = 0; h < 2; ++h) {
    const int64_t key = k0 + 16 * warp + g + 8 * h;
    key_ok[h] = key < s.sk;
    kpos[h] = key_ok[h] ? a.k_pos[key] : INT_MAX;
  }
  const float c = s.scale * kLog2e;
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  int stage = 0;
  while (it < n_iter) {
    const int next = next_visible(it + 1, n_iter, visible);
    cp_async_wait_all();
    __syncthreads();  // tile it (and K, V) landed; nobody still reads stage ^ 1
    if (next < n_iter) load_q(next, stage ^ 1);
    cp_async_commit();
    const int qt = it % n_q;
    const int2 qbound = qb[qt];
    const bool masked = qbound.x < kbound.y || int64_t{qt + 1} * kTileRows > s.sq || k0 + kTileRows > s.sk ||
                        behind_window(qbound.y, kbound.x, s.window);
    const nv_bf16* qs = smem + L::kC + stage * L::kTile;
    const nv_bf16* dos = smem + L::kD + stage * L::kTile;
    const float* lse2 = lse2_s + stage * kTileRows;
    const float* delta = delta_s + stage * kTileRows;
    const int* qpos = qpos_s + stage * kTileRows;
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // queries 32 half .. 32 half + 31 of the tile
      float st[4][4] = {}, dpt[4][4] = {};  // S^T, dP^T: 16 keys x 32 queries
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t kf[4], vf[4];
        ldmatrix_x4(kf, smem + L::kA + offset_a_order(16 * warp, 16 * kc, kS));
        ldmatrix_x4(vf, smem + L::kB + offset_a_order(16 * warp, 16 * kc, kS));
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          uint32_t qf[4], of[4];
          ldmatrix_x4(qf, qs + offset_b_order(32 * half + 16 * jp, 16 * kc, kS));
          ldmatrix_x4(of, dos + offset_b_order(32 * half + 16 * jp, 16 * kc, kS));
          mma_16816(st[2 * jp], kf, qf[0], qf[1]);
          mma_16816(st[2 * jp + 1], kf, qf[2], qf[3]);
          mma_16816(dpt[2 * jp], vf, of[0], of[1]);
          mma_16816(dpt[2 * jp + 1], vf, of[2], of[3]);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 32 * half + 8 * j + 2 * t + (e & 1), h = e >> 1;  // query col, key row g + 8h
          float p = exp2f(st[j][e] * c - lse2[col]);
          if (masked && !(key_ok[h] && sees(qpos[col], kpos[h], s.window))) p = 0.0f;
          st[j][e] = p;
          dpt[j][e] = p * (dpt[j][e] - delta[col]) * s.scale;
        }
      }
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {  // over queries 32 half + 16kk .. +15
        uint32_t pf[4], df[4];
        pack_a(pf, st[2 * kk], st[2 * kk + 1]);
        pack_a(df, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
          uint32_t of[4], qf[4];
          ldmatrix_x4_trans(of, dos + offset_a_order(32 * half + 16 * kk, 16 * np, kS));
          ldmatrix_x4_trans(qf, qs + offset_a_order(32 * half + 16 * kk, 16 * np, kS));
          mma_16816(dv[2 * np], pf, of[0], of[1]);
          mma_16816(dv[2 * np + 1], pf, of[2], of[3]);
          mma_16816(dk[2 * np], df, qf[0], qf[1]);
          mma_16816(dk[2 * np + 1], df, qf[2], qf[3]);
        }
      }
    }
    it = next;
    stage ^= 1;
  }
  cp_async_wait_all();
  const float one[2] = {1.0f, 1.0f};
  store_rows<D>(dk, one, a.dk, b, k0 + 16 * warp, s.sk, s.n_kv, hk);
  store_rows<D>(dv, one, a.dv, b, k0 + 16 * warp, s.sk, s.n_kv, hk);
}

// dQ: grid (ceil(Sq / 64), n_h, B), 128 threads, blockIdx.x from the last query tile. Warp w
// owns query rows 16w..16w+15; per visible 64-key tile (K/V double-buffered): S = Q K^T,
// dP = dO V^T (16 x 64 per warp), dS = P (dP - delta) scale, dQ += dS K. Q and dO fragments
// are re-read from shared memory per tile (holding them would need 64 more registers).
template <int D>
__global__ void __launch_bounds__(kBwdThreads, 2) attention_dq_tc_kernel(TcArgs a) {
  using L = BwdSmem<D>;
  constexpr int kS = L::kStride;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  nv_bf16* smem = reinterpret_cast<nv_bf16*>(smem_bytes);
  const AttentionShape& s = a.s;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int qt = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  const int64_t b = blockIdx.z, hq = blockIdx.y, hk = hq / (s.n_h / s.n_kv), q0 = int64_t{qt} * kTileRows;
  const int n_k = a.k_tiles();
  const int2 qbound = a.q_bounds()[qt];
  const int2* kb = a.k_bounds();
  auto visible = [&](int kt) { return kb[kt].x <= qbound.y && !behind_window(qbound.x, kb[kt].y, s.window); };
  auto load_kv = [&](int kt, int stage) {
    const int64_t k0 = int64_t{kt} * kTileRows;
    load_tile<D, kBwdThreads>(a.k, b, k0, s.sk, s.n_kv, hk, kTileRows, smem + L::kC + stage * L::kTile);
    load_tile<D, kBwdThreads>(a.v, b, k0, s.sk, s.n_kv, hk, kTileRows, smem + L::kD + stage * L::kTile);
  };

  load_tile<D, kBwdThreads>(a.q, b, q0, s.sq, s.n_h, hq, kTileRows, smem + L::kA);
  load_tile<D, kBwdThreads>(a.d_out, b, q0, s.sq, s.n_h, hq, kTileRows, smem + L::kB);
  int kt = next_visible(0, n_k, visible);
  if (kt < n_k) load_kv(kt, 0);
  cp_async_commit();
  int qp[2];
  float lse2[2], delta[2];
  for (int h = 0; h < 2; ++h) {
    const int64_t row = q0 + 16 * warp + g + 8 * h;
    qp[h] = row < s.sq ? a.q_pos[row] : INT_MIN;
    lse2[h] = a.lse2(hq, b, row);
    delta[h] = row < s.sq ? a.delta[(b * s.n_h + hq) * s.sq + row] : 0.0f;
  }
  const float c = s.scale * kLog2e;
  float dq[D / 8][4] = {};
  int stage = 0;
  while (kt < n_k) {
    const int next = next_visible(kt + 1, n_k, visible);
    cp_async_wait_all();
    __syncthreads();  // tile kt (and Q, dO) landed; nobody still reads stage ^ 1
    if (next < n_k) load_kv(next, stage ^ 1);
    cp_async_commit();
    const int64_t k0 = int64_t{kt} * kTileRows;
    const bool masked = kb[kt].y > qbound.x || k0 + kTileRows > s.sk || behind_window(qbound.y, kb[kt].x, s.window);
    const nv_bf16* ks = smem + L::kC + stage * L::kTile;
    const nv_bf16* vs = smem + L::kD + stage * L::kTile;

    float sc[8][4] = {}, dp[8][4] = {};  // S, dP: 16 rows x 64 keys
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t qf[4], of[4];
      ldmatrix_x4(qf, smem + L::kA + offset_a_order(16 * warp, 16 * kc, kS));
      ldmatrix_x4(of, smem + L::kB + offset_a_order(16 * warp, 16 * kc, kS));
#pragma unroll
      for (int jp = 0; jp < 4; ++jp) {
        uint32_t kf[4], vf[4];
        ldmatrix_x4(kf, ks + offset_b_order(16 * jp, 16 * kc, kS));
        ldmatrix_x4(vf, vs + offset_b_order(16 * jp, 16 * kc, kS));
        mma_16816(sc[2 * jp], qf, kf[0], kf[1]);
        mma_16816(sc[2 * jp + 1], qf, kf[2], kf[3]);
        mma_16816(dp[2 * jp], of, vf[0], vf[1]);
        mma_16816(dp[2 * jp + 1], of, vf[2], vf[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t key = k0 + 8 * j + 2 * t + e;
        const int kpos = masked && key < s.sk ? a.k_pos[key] : INT_MIN;
        for (int h = 0; h < 2; ++h) {
          float p = exp2f(sc[j][2 * h + e] * c - lse2[h]);
          if (masked && !(key < s.sk && sees(qp[h], kpos, s.window))) p = 0.0f;
          sc[j][2 * h + e] = p * (dp[j][2 * h + e] - delta[h]) * s.scale;  // dS
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // dQ += dS K over keys 16kk..16kk+15
      uint32_t df[4];
      pack_a(df, sc[2 * kk], sc[2 * kk + 1]);
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        uint32_t kf[4];
        ldmatrix_x4_trans(kf, ks + offset_a_order(16 * kk, 16 * np, kS));
        mma_16816(dq[2 * np], df, kf[0], kf[1]);
        mma_16816(dq[2 * np + 1], df, kf[2], kf[3]);
      }
    }
    kt = next;
    stage ^= 1;
  }
  cp_async_wait_all();
  const float one[2] = {1.0f, 1.0f};
  store_rows<D>(dq, one, a.dq, b, q0 + 16 * warp, s.sq, s.n_h, hq);
}

// ---- host side ---------------------------------------------------------------------------
int tiles_of(int64_t rows) { return static_cast<int>((rows + kTileRows - 1) / kTileRows); }

template <typename Kernel>
void launch(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream, const TcArgs& a) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  kernel<<<grid, threads, smem, stream>>>(a);
  FP_CUDA_LAUNCHED();
}

void launch_tile_bounds(const AttentionShape& s, const int32_t* q_pos, const int32_t* k_pos, int32_t* tile_bounds,
                        cudaStream_t stream) {
  const int n_q = tiles_of(s.sq), n_k = tiles_of(s.sk);
  if (n_q + n_k == 0) return;
  const unsigned blocks = static_cast<unsigned>((int64_t{n_q + n_k} * 32 + kThreads - 1) / kThreads);
  tile_bounds_kernel<<<blocks, kThreads, 0, stream>>>(q_pos, s.sq, k_pos, s.sk, n_q, n_k,
                                                      reinterpret_cast<int2*>(tile_bounds));
  FP_CUDA_LAUNCHED();
}

TcArgs args_of(const AttentionShape& s, FloatPtr q, FloatPtr k, FloatPtr v, const int32_t* q_pos,
               const int32_t* k_pos, const int32_t* tile_bounds) {
  TcArgs a{};
  a.s = s;
  a.q = static_cast<const nv_bf16*>(q.p);
  a.k = static_cast<const nv_bf16*>(k.p);
  a.v = static_cast<const nv_bf16*>(v.p);
  a.q_pos = q_pos;
  a.k_pos = k_pos;
  a.bounds = reinterpret_cast<const int2*>(tile_bounds);
  return a;
}

void check_supported(const AttentionShape& s, DType dtype, const char* what) {
  if (!attention_tc_supported(s, dtype)) kernel_contract_violated(__FILE__, __LINE__, what);
}

template <int D>
void forward_d(const TcArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.s.sq + kFwdRows - 1) / kFwdRows), static_cast<unsigned>(a.s.n_h),
                  static_cast<unsigned>(a.s.batch));
  launch(attention_forward_tc_kernel<D>, grid, kFwdThreads, FwdSmem<D>::kBytes, stream, a);
}

template <int D>
void backward_d(const TcArgs& a, cudaStream_t stream) {
  const AttentionShape& s = a.s;
  if (s.sk > 0) {
    launch(attention_dkdv_tc_kernel<D>,
           dim3(static_cast<unsigned>(tiles_of(s.sk)), static_cast<unsigned>(s.n_kv), static_cast<unsigned>(s.batch)),
           kBwdThreads, BwdSmem<D>::kBytes, stream, a);
  }
  if (s.sq > 0) {
    launch(attention_dq_tc_kernel<D>,
           dim3(static_cast<unsigned>(tiles_of(s.sq)), static_cast<unsigned>(s.n_h), static_cast<unsigned>(s.batch)),
           kBwdThreads, BwdSmem<D>::kBytes, stream, a);
  }
}

static_assert(FwdSmem<128>::kBytes == 104448 && BwdSmem<128>::kBytes == 105984, "the sizes docs/GPU.md quotes");
static_assert(2 * (BwdSmem<128>::kBytes + 1024) <= 228 * 1024, "two backward CTAs per SM (sm_90: 228 KB, 1 KB each)");

}  // namespace

bool attention_tc_supported(const AttentionShape& s, DType dtype) {
  return dtype == DType::kBF16 && (s.d == 64 || s.d == 128);
}

int64_t attention_tc_workspace_words(const AttentionShape& s) { return 2 * int64_t{tiles_of(s.sq) + tiles_of(s.sk)}; }

void launch_attention_forward_tc(const AttentionShape& s, FloatPtr q, FloatPtr k, FloatPtr v, const int32_t* q_pos,
                                 const int32_t* k_pos, FloatOut out, float* lse, int32_t* tile_bounds,
                                 cudaStream_t stream) {
  check_supported(s, q.dtype, "launch_attention_forward_tc: needs bf16 and d in {64, 128}");
  if (s.batch * s.sq * s.n_h == 0) return;
  launch_tile_bounds(s, q_pos, k_pos, tile_bounds, stream);
  TcArgs a = args_of(s, q, k, v, q_pos, k_pos, tile_bounds);
  a.o = static_cast<nv_bf16*>(out.p);
  a.lse = lse;
  if (s.d == 64) {
    forward_d<64>(a, stream);
  } else {
    forward_d<128>(a, stream);
  }
}

void launch_attention_backward_tc(const AttentionShape& s, FloatPtr q, FloatPtr k, FloatPtr v, FloatPtr out,
                                  const float* lse, FloatPtr d_out, const int32_t* q_pos, const int32_t* k_pos,
                                  float* delta, int32_t* tile_bounds, FloatOut dq, FloatOut dk, FloatOut dv,
                                  cudaStream_t stream) {
  check_supported(s, q.dtype, "launch_attention_backward_tc: needs bf16 and d in {64, 128}");
  if (s.batch * (s.sq * s.n_h + s.sk * s.n_kv) == 0) return;
  launch_tile_bounds(s, q_pos, k_pos, tile_bounds, stream);
  const int64_t rows = s.batch * s.n_h * s.sq;
  if (rows > 0) {
    attention_delta_tc_kernel<<<static_cast<unsigned>((rows * 32 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        s, static_cast<const nv_bf16*>(out.p), static_cast<const nv_bf16*>(d_out.p), delta);
    FP_CUDA_LAUNCHED();
  }
  TcArgs a = args_of(s, q, k, v, q_pos, k_pos, tile_bounds);
  a.d_out = static_cast<const nv_bf16*>(d_out.p);
  a.lse_in = lse;
  a.delta = delta;
  a.dq = static_cast<nv_bf16*>(dq.p);
  a.dk = static_cast<nv_bf16*>(dk.p);
  a.dv = static_cast<nv_bf16*>(dv.p);
  if (s.d == 64) {
    backward_d<64>(a, stream);
  } else {
    backward_d<128>(a, stream);
  }
}

}  // namespace foldpar::cuda
