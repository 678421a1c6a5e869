// Causal flash attention on the GPU with explicit positions (key j visible to query i iff
// k_pos[j] <= q_pos[i], and q_pos[i] - k_pos[j] < W with a sliding window W) and GQA. A
// straightforward tiled kernel, correctness first: f32 CUDA-core arithmetic on f32 or bf16
// storage, tiles of 32 queries x 32 keys staged in shared memory, the online softmax of
// FlashAttention (running max and sum per row, f32).
// Each warp owns 4 rows of its tile; a lane owns one column of the score tile and d/32
// columns of the accumulators, in registers. Tiles whose smallest key position exceeds
// the largest query position, or whose largest key position lies behind the window of the
// smallest query position, are skipped (positions need not be sorted).
// Backward follows FlashAttention-2 without atomics: one kernel per key tile writes dK and
// dV (looping over every query tile of every head of the GQA group), one per query tile
// writes dQ; both recompute P from the forward's lse. Not tensor-core code: see docs/GPU.md.
#include <climits>

#include "backend/cuda/cuda_common.cuh"

namespace foldpar::cuda {
namespace {

constexpr int kTile = 32;           // rows of a query tile = rows of a key tile = lanes
constexpr int kWarps = 8;           // 8 warps x 4 rows = 32 rows
constexpr int kRowsPerWarp = kTile / kWarps;
constexpr int kCols = kMaxHeadDim / 32;  // accumulator columns per lane

struct Layout {
  int64_t seq, heads, d;
  // Element (b, row, head, e) of a [B, seq, heads, d] tensor.
  __device__ int64_t at(int64_t b, int64_t row, int64_t head, int64_t e) const {
    return ((b * seq + row) * heads + head) * d + e;
  }
};

// Loads rows [row0, row0 + kTile) of one head into smem with row stride `stride`; rows past
// `seq` are zero.
__device__ void load_tile(FloatPtr src, const Layout& l, int64_t b, int64_t row0, int64_t head, float* dst,
                          int stride) {
  for (int idx = threadIdx.x; idx < kTile * l.d; idx += blockDim.x) {
    const int r = idx / static_cast<int>(l.d), e = idx % static_cast<int>(l.d);
    const int64_t row = row0 + r;
    dst[r * stride + e] = row < l.seq ? load(src, l.at(b, row, head, e)) : 0.0f;
  }
}

// Loads the positions of rows [row0, row0 + kTile) (`fill` past `seq`) and returns their
// min (want_min) or max over the valid rows, to every thread.
__device__ int load_positions(const int32_t* pos, int64_t row0, int64_t seq, int fill, int* dst, bool want_min,
                              int* scratch) {
  if (threadIdx.x < kTile) {
    const int64_t row = row0 + threadIdx.x;
    dst[threadIdx.x] = row < seq ? pos[row] : fill;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int v = want_min ? INT_MAX : INT_MIN;
    for (int i = 0; i < kTile && row0 + i < seq; ++i) v = want_min ? min(v, dst[i]) : max(v, dst[i]);
    *scratch = v;
  }
  __syncthreads();
  return *scratch;
}

__device__ float dot_row(const float* a, const float* b, int d) {
  float s = 0;
  for (int e = 0; e < d; ++e) s += a[e] * b[e];
  return s;
}

// grid (ceil(Sq / 32), n_h, B), 256 threads.
__global__ void attention_forward_kernel(AttentionShape s, FloatPtr q, FloatPtr k, FloatPtr v, const int32_t* q_pos,
                                         const int32_t* k_pos, FloatOut out, float* lse) {
  extern __shared__ float smem[];
  const int d = static_cast<int>(s.d), dp = d + 1;
  float* Qs = smem;               // [32][d]
  float* Ks = Qs + kTile * d;     // [32][d + 1]
  float* Vs = Ks + kTile * dp;    // [32][d]
  float* Ps = Vs + kTile * d;     // [32][32]
  int* qp = reinterpret_cast<int*>(Ps + kTile * kTile);
  int* kp = qp + kTile;
  int* scratch = kp + kTile;
  const int64_t b = blockIdx.z, hq = blockIdx.y, hk = hq / (s.n_h / s.n_kv), q0 = int64_t{blockIdx.x} * kTile;
  const Layout lq{s.sq, s.n_h, s.d}, lk{s.sk, s.n_kv, s.d};
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  load_tile(q, lq, b, q0, hq, Qs, d);
  const int q_min = load_positions(q_pos, q0, s.sq, INT_MAX, qp, true, scratch);
  const int q_max = load_positions(q_pos, q0, s.sq, INT_MIN, qp, false, scratch);  // leaves INT_MIN past Sq
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kCols];
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0;
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0;
  }
  for (int64_t k0 = 0; k0 < s.sk; k0 += kTile) {
    __syncthreads();  // the previous tile's Ks, Vs, Ps, kp are no longer read
    const int k_max = load_positions(k_pos, k0, s.sk, INT_MIN, kp, false, scratch);
    const int k_min = load_positions(k_pos, k0, s.sk, INT_MAX, kp, true, scratch);
    if (k_min > q_max || behind_window(q_min, k_max, s.window)) continue;  // uniform across the block
    load_tile(k, lk, b, k0, hk, Ks, dp);
    load_tile(v, lk, b, k0, hk, Vs, d);
    __syncthreads();
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = warp * kRowsPerWarp + r;
      const bool visible = k0 + lane < s.sk && sees(qp[i], kp[lane], s.window);
      const float score = visible ? dot_row(Qs + i * d, Ks + lane * dp, d) * s.scale : -INFINITY;
      const float m_new = fmaxf(m[r], warp_max(score));
      const float p = m_new == -INFINITY ? 0.0f : __expf(score - m_new);
      const float alpha = m_new == -INFINITY ? 1.0f : __expf(m[r] - m_new);
      l[r] = l[r] * alpha + warp_sum(p);
      m[r] = m_new;
      Ps[i * kTile + lane] = p;
      for (int c = 0; c < kCols; ++c) acc[r][c] *= alpha;
    }
    __syncwarp();
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = warp * kRowsPerWarp + r;
      for (int j = 0; j < kTile; ++j) {
        const float p = Ps[i * kTile + j];
        if (p == 0.0f) continue;
        for (int c = 0; c < kCols; ++c) {
          const int col = lane + 32 * c;
          if (col < d) acc[r][c] += p * Vs[j * d + col];
        }
      }
    }
  }
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t row = q0 + warp * kRowsPerWarp + r;
    if (row >= s.sq) continue;
    const float inv = l[r] > 0 ? 1.0f / l[r] : 0.0f;
    for (int c = 0; c < kCols; ++c) {
      const int col = lane + 32 * c;
      if (col < d) store(out, lq.at(b, row, hq, col), acc[r][c] * inv);
    }
    if (lane == 0) lse[(b * s.n_h + hq) * s.sq + row] = l[r] > 0 ? m[r] + logf(l[r]) : -INFINITY;
  }
}

// delta[b, h, i] = sum_e dO[b, i, h, e] * O[b, i, h, e]; one warp per row.
__global__ void attention_delta_kernel(AttentionShape s, FloatPtr out, FloatPtr d_out, float* delta) {
  const int64_t warp_id = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp_id >= s.batch * s.n_h * s.sq) return;
  const int64_t i = warp_id % s.sq, hq = (warp_id / s.sq) % s.n_h, b = warp_id / (s.sq * s.n_h);
  const Layout lq{s.sq, s.n_h, s.d};
  float acc = 0;
  for (int64_t e = lane; e < s.d; e += 32) acc += load(d_out, lq.at(b, i, hq, e)) * load(out, lq.at(b, i, hq, e));
  acc = warp_sum(acc);
  if (lane == 0) delta[warp_id] = acc;  // warp_id == (b * n_h + hq) * Sq + i
}

// grid (ceil(Sk / 32), n_kv, B). Warp w owns keys 4w..4w+3 of the tile; a lane is a query.
__global__ void attention_dkdv_kernel(AttentionShape s, FloatPtr q, FloatPtr k, FloatPtr v, const float* lse,
                                      const float* delta, FloatPtr d_out, const int32_t* q_pos, const int32_t* k_pos,
                                      FloatOut dk, FloatOut dv) {
  extern __shared__ float smem[];
  const int d = static_cast<int>(s.d), dp = d + 1;
  float* Ks = smem;                 // [32][d]
  float* Vs = Ks + kTile * d;       // [32][d]
  float* Qs = Vs + kTile * d;       // [32][d + 1]
  float* dOs = Qs + kTile * dp;     // [32][d + 1]
  float* Pt = dOs + kTile * dp;     // [key][query]
  float* dSt = Pt + kTile * kTile;  // [key][query]
  int* qp = reinterpret_cast<int*>(dSt + kTile * kTile);
  int* kp = qp + kTile;
  int* scratch = kp + kTile;
  const int64_t b = blockIdx.z, hk = blockIdx.y, k0 = int64_t{blockIdx.x} * kTile, group = s.n_h / s.n_kv;
  const Layout lq{s.sq, s.n_h, s.d}, lk{s.sk, s.n_kv, s.d};
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  load_tile(k, lk, b, k0, hk, Ks, d);
  load_tile(v, lk, b, k0, hk, Vs, d);
  const int k_max = load_positions(k_pos, k0, s.sk, INT_MIN, kp, false, scratch);
  const int k_min = load_positions(k_pos, k0, s.sk, INT_MAX, kp, true, scratch);
  float dk_acc[kRowsPerWarp][kCols] = {}, dv_acc[kRowsPerWarp][kCols] = {};
  for (int64_t hq = hk * group; hq < (hk + 1) * group; ++hq) {
    for (int64_t q0 = 0; q0 < s.sq; q0 += kTile) {
      __syncthreads();
      const int q_min = load_positions(q_pos, q0, s.sq, INT_MAX, qp, true, scratch);
      const int q_max = load_positions(q_pos, q0, s.sq, INT_MIN, qp, false, scratch);
      if (k_min > q_max || behind_window(q_min, k_max, s.window)) continue;
      load_tile(q, lq, b, q0, hq, Qs, dp);
      load_tile(d_out, lq, b, q0, hq, dOs, dp);
      __syncthreads();
      const int64_t qi = q0 + lane;
      const float row_lse = qi < s.sq ? lse[(b * s.n_h + hq) * s.sq + qi] : -INFINITY;
      const float row_delta = qi < s.sq ? delta[(b * s.n_h + hq) * s.sq + qi] : 0.0f;
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int j = warp * kRowsPerWarp + r;
        const bool visible = qi < s.sq && k0 + j < s.sk && sees(qp[lane], kp[j], s.window) && row_lse != -INFINITY;
        float p = 0, ds = 0;
        if (visible) {
          p = __expf(dot_row(Ks + j * d, Qs + lane * dp, d) * s.scale - row_lse);
          ds = p * (dot_row(Vs + j * d, dOs + lane * dp, d) - row_delta) * s.scale;
        }
        Pt[j * kTile + lane] = p;
        dSt[j * kTile + lane] = ds;
      }
      __syncwarp();
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int j = warp * kRowsPerWarp + r;
        for (int i = 0; i < kTile; ++i) {
          const float p = Pt[j * kTile + i], ds = dSt[j * kTile + i];
          for (int c = 0; c < kCols; ++c) {
            const int col = lane + 32 * c;
            if (col < d) {
              dv_acc[r][c] += p * dOs[i * dp + col];
              dk_acc[r][c] += ds * Qs[i * dp + col];
            }
          }
        }
      }
    }
  }
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t row = k0 + warp * kRowsPerWarp + r;
    if (row >= s.sk) continue;
    for (int c = 0; c < kCols; ++c) {
      const int col = lane + 32 * c;
      if (col < d) {
        store(dk, lk.at(b, row, hk, col), dk_acc[r][c]);
        store(dv, lk.at(b, row, hk, col), dv_acc[r][c]);
      }
    }
  }
}

// grid (ceil(Sq / 32), n_h, B). Warp w owns queries 4w..4w+3 of the tile; a lane is a key.
__global__ void attention_dq_kernel(AttentionShape s, FloatPtr q, FloatPtr k, FloatPtr v, const float* lse,
                                    const float* delta, FloatPtr d_out, const int32_t* q_pos, const int32_t* k_pos,
                                    FloatOut dq) {
  extern __shared__ float smem[];
  const int d = static_cast<int>(s.d), dp = d + 1;
  float* Qs = smem;              // [32][d]
  float* dOs = Qs + kTile * d;   // [32][d]
  float* Ks = dOs + kTile * d;   // [32][d + 1]
  float* Vs = Ks + kTile * dp;   // [32][d + 1]
  float* dS = Vs + kTile * dp;   // [query][key]
  int* qp = reinterpret_cast<int*>(dS + kTile * kTile);
  int* kp = qp + kTile;
  int* scratch = kp + kTile;
  const int64_t b = blockIdx.z, hq = blockIdx.y, hk = hq / (s.n_h / s.n_kv), q0 = int64_t{blockIdx.x} * kTile;
  const Layout lq{s.sq, s.n_h, s.d}, lk{s.sk, s.n_kv, s.d};
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  load_tile(q, lq, b, q0, hq, Qs, d);
  load_tile(d_out, lq, b, q0, hq, dOs, d);
  const int q_min = load_positions(q_pos, q0, s.sq, INT_MAX, qp, true, scratch);
  const int q_max = load_positions(q_pos, q0, s.sq, INT_MIN, qp, false, scratch);
  float row_lse[kRowsPerWarp], row_delta[kRowsPerWarp], acc[kRowsPerWarp][kCols] = {};
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t qi = q0 + warp * kRowsPerWarp + r;
    row_lse[r] = qi < s.sq ? lse[(b * s.n_h + hq) * s.sq + qi] : -INFINITY;
    row_delta[r] = qi < s.sq ? delta[(b * s.n_h + hq) * s.sq + qi] : 0.0f;
  }
  for (int64_t k0 = 0; k0 < s.sk; k0 += kTile) {
    __syncthreads();
    const int k_max = load_positions(k_pos, k0, s.sk, INT_MIN, kp, false, scratch);
    const int k_min = load_positions(k_pos, k0, s.sk, INT_MAX, kp, true, scratch);
    if (k_min > q_max || behind_window(q_min, k_max, s.window)) continue;
    load_tile(k, lk, b, k0, hk, Ks, dp);
    load_tile(v, lk, b, k0, hk, Vs, dp);
    __syncthreads();
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = warp * kRowsPerWarp + r;
      const bool visible = k0 + lane < s.sk && sees(qp[i], kp[lane], s.window) && row_lse[r] != -INFINITY;
      float ds = 0;
      if (visible) {
        const float p = __expf(dot_row(Qs + i * d, Ks + lane * dp, d) * s.scale - row_lse[r]);
        ds = p * (dot_row(dOs + i * d, Vs + lane * dp, d) - row_delta[r]) * s.scale;
      }
      dS[i * kTile + lane] = ds;
    }
    __syncwarp();
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = warp * kRowsPerWarp + r;
      for (int j = 0; j < kTile; ++j) {
        const float ds = dS[i * kTile + j];
        if (ds == 0.0f) continue;
        for (int c = 0; c < kCols; ++c) {
          const int col = lane + 32 * c;
          if (col < d) acc[r][c] += ds * Ks[j * dp + col];
        }
      }
    }
  }
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t row = q0 + warp * kRowsPerWarp + r;
    if (row >= s.sq) continue;
    for (int c = 0; c < kCols; ++c) {
      const int col = lane + 32 * c;
      if (col < d) store(dq, lq.at(b, row, hq, col), acc[r][c]);
    }
  }
}

size_t forward_smem(int64_t d) { return sizeof(float) * (kTile * (3 * d + 1) + kTile * kTile) + sizeof(int) * (2 * kTile + 1); }
size_t backward_smem(int64_t d) {
  return sizeof(float) * (kTile * (4 * d + 2) + 2 * kTile * kTile) + sizeof(int) * (2 * kTile + 1);
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

dim3 grid_of(int64_t rows, int64_t heads, int64_t batch) {
  return dim3(static_cast<unsigned>((rows + kTile - 1) / kTile), static_cast<unsigned>(heads),
              static_cast<unsigned>(batch));
}

}  // namespace

void launch_attention_forward(const AttentionShape& s, FloatPtr q, FloatPtr k, FloatPtr v, const int32_t* q_pos,
                              const int32_t* k_pos, FloatOut out, float* lse, cudaStream_t stream) {
  if (s.batch * s.sq * s.n_h == 0) return;
  const size_t bytes = forward_smem(s.d);
  allow_smem(attention_forward_kernel, bytes);
  attention_forward_kernel<<<grid_of(s.sq, s.n_h, s.batch), kWarps * 32, bytes, stream>>>(s, q, k, v, q_pos, k_pos,
                                                                                           out, lse);
  FP_CUDA_LAUNCHED();
}

void launch_attention_backward(const AttentionShape& s, FloatPtr q, FloatPtr k, FloatPtr v, FloatPtr out,
                               const float* lse, FloatPtr d_out, const int32_t* q_pos, const int32_t* k_pos,
                               float* delta, FloatOut dq, FloatOut dk, FloatOut dv, cudaStream_t stream) {
  const int64_t rows = s.batch * s.n_h * s.sq;
  if (rows > 0) {
    attention_delta_kernel<<<static_cast<unsigned>((rows * 32 + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        s, out, d_out, delta);
    FP_CUDA_LAUNCHED();
  }
  const size_t bytes = backward_smem(s.d);
  if (s.batch * s.sk * s.n_kv > 0) {
    allow_smem(attention_dkdv_kernel, bytes);
    attention_dkdv_kernel<<<grid_of(s.sk, s.n_kv, s.batch), kWarps * 32, bytes, stream>>>(
        s, q, k, v, lse, delta, d_out, q_pos, k_pos, dk, dv);
    FP_CUDA_LAUNCHED();
  }
  if (rows > 0) {
    allow_smem(attention_dq_kernel, bytes);
    attention_dq_kernel<<<grid_of(s.sq, s.n_h, s.batch), kWarps * 32, bytes, stream>>>(s, q, k, v, lse, delta, d_out,
                                                                                        q_pos, k_pos, dq);
    FP_CUDA_LAUNCHED();
  }
}

}  // namespace foldpar::cuda
