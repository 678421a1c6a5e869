// Row-wise kernels of the CUDA backend: embedding lookup and its scatter-add, RMSNorm
// forward/backward, RoPE rotation. RMSNorm runs one block per token row (block-wide f32
// reductions); its weight gradient sums over rows in column-parallel chunks into an f32
// workspace, then adds once into dw (so a bf16 dw is rounded once, as on the CPU).
#include "backend/cuda/cuda_common.cuh"

namespace foldpar::cuda {
namespace {

__global__ void embedding_forward_kernel(const int32_t* ids, int64_t T, FloatPtr table, int64_t rows, int64_t h,
                                         int64_t off, FloatOut out) {
  FP_GRID_STRIDE(i, T * h) {
    const int64_t t = i / h, c = i % h, r = ids[t] - off;
    if (r >= 0 && r < rows) store(out, i, load(table, r * h + c));
  }
}

__global__ void embedding_backward_kernel(const int32_t* ids, int64_t T, FloatPtr d_out, int64_t rows, int64_t h,
                                          int64_t off, FloatOut d_table) {
  FP_GRID_STRIDE(i, T * h) {
    const int64_t t = i / h, c = i % h, r = ids[t] - off;
    if (r < 0 || r >= rows) continue;
    const float g = load(d_out, i);
    if (d_table.dtype == DType::kBF16) {
      atomicAdd(static_cast<__nv_bfloat16*>(d_table.p) + r * h + c, __float2bfloat16_rn(g));
    } else {
      atomicAdd(static_cast<float*>(d_table.p) + r * h + c, g);
    }
  }
}

__global__ void rmsnorm_forward_kernel(FloatPtr x, FloatPtr w, float eps, int64_t h, FloatOut y, FloatOut rstd) {
  __shared__ float smem[32];
  const int64_t row = blockIdx.x;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    const float v = load(x, row * h + c);
    ss += v * v;
  }
  const float s = rsqrtf(block_sum(ss, smem) / static_cast<float>(h) + eps);
  if (threadIdx.x == 0) store(rstd, row, s);
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) store(y, row * h + c, load(x, row * h + c) * s * load(w, c));
}

// dx_i = s * (g_i - x_i * s^2 * mean(g . x)), g = dy . w (see the reference backend).
__global__ void rmsnorm_dx_kernel(FloatPtr x, FloatPtr w, FloatPtr rstd, FloatPtr dy, int64_t h, FloatOut dx) {
  __shared__ float smem[32];
  const int64_t row = blockIdx.x;
  float dot = 0;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) dot += load(dy, row * h + c) * load(w, c) * load(x, row * h + c);
  const float s = load(rstd, row);
  const float coef = s * s * s * block_sum(dot, smem) / static_cast<float>(h);
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    store(dx, row * h + c, s * load(dy, row * h + c) * load(w, c) - coef * load(x, row * h + c));
  }
}

constexpr int64_t kDwRowsPerBlock = 64;
// grid (column blocks, row chunks): each thread sums one column over kDwRowsPerBlock rows.
__global__ void rmsnorm_dw_kernel(FloatPtr x, FloatPtr rstd, FloatPtr dy, int64_t T, int64_t h, float* dw) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= h) return;
  const int64_t r0 = blockIdx.y * kDwRowsPerBlock, r1 = r0 + kDwRowsPerBlock < T ? r0 + kDwRowsPerBlock : T;
  float acc = 0;
  for (int64_t r = r0; r < r1; ++r) acc += load(dy, r * h + c) * load(x, r * h + c) * load(rstd, r);
  atomicAdd(dw + c, acc);
}

__global__ void accumulate_f32_kernel(const float* src, FloatOut dst, int64_t n) {
  FP_GRID_STRIDE(i, n) store(dst, i, load(dst, i) + src[i]);
}

__global__ void rope_kernel(FloatPtr table, FloatOut x, int64_t B, int64_t S, int64_t n, int64_t d, float sign) {
  const int64_t half = d / 2;
  FP_GRID_STRIDE(i, B * S * n * half) {
    const int64_t e = i % half, row = i / half;  // row = (b * S + s) * n + head
    const int64_t s = (row / n) % S;
    const float c = load(table, s * 2 * half + e), sn = sign * load(table, (s * 2 + 1) * half + e);
    const int64_t base = row * d;
    const float x1 = load(x, base + e), x2 = load(x, base + e + half);
    store(x, base + e, x1 * c - x2 * sn);
    store(x, base + e + half, x2 * c + x1 * sn);
  }
}

}  // namespace

void launch_embedding_forward(const int32_t* ids, int64_t T, FloatPtr table, int64_t rows, int64_t h,
                              int64_t vocab_offset, FloatOut out, cudaStream_t stream) {
  if (T * h == 0) return;
  embedding_forward_kernel<<<grid_for(T * h), kThreads, 0, stream>>>(ids, T, table, rows, h, vocab_offset, out);
  FP_CUDA_LAUNCHED();
}
void launch_embedding_backward(const int32_t* ids, int64_t T, FloatPtr d_out, int64_t rows, int64_t h,
                               int64_t vocab_offset, FloatOut d_table, cudaStream_t stream) {
  if (T * h == 0) return;
  embedding_backward_kernel<<<grid_for(T * h), kThreads, 0, stream>>>(ids, T, d_out, rows, h, vocab_offset, d_table);
  FP_CUDA_LAUNCHED();
}
void launch_rmsnorm_forward(FloatPtr x, FloatPtr w, double eps, int64_t T, int64_t h, FloatOut y, FloatOut rstd,
                            cudaStream_t stream) {
  if (T == 0) return;
  rmsnorm_forward_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(x, w, static_cast<float>(eps), h, y, rstd);
  FP_CUDA_LAUNCHED();
}
void launch_rmsnorm_backward(FloatPtr x, FloatPtr w, FloatPtr rstd, FloatPtr dy, int64_t T, int64_t h, FloatOut dx,
                             FloatOut dw, float* dw_scratch, cudaStream_t stream) {
  if (T == 0 || h == 0) return;
  rmsnorm_dx_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(x, w, rstd, dy, h, dx);
  FP_CUDA_LAUNCHED();
  cudaMemsetAsync(dw_scratch, 0, static_cast<size_t>(h) * sizeof(float), stream);
  const dim3 grid(static_cast<unsigned>((h + kThreads - 1) / kThreads),
                  static_cast<unsigned>((T + kDwRowsPerBlock - 1) / kDwRowsPerBlock));
  rmsnorm_dw_kernel<<<grid, kThreads, 0, stream>>>(x, rstd, dy, T, h, dw_scratch);
  FP_CUDA_LAUNCHED();
  accumulate_f32_kernel<<<grid_for(h), kThreads, 0, stream>>>(dw_scratch, dw, h);
  FP_CUDA_LAUNCHED();
}
void launch_rope(FloatPtr table, FloatOut x, int64_t B, int64_t S, int64_t n, int64_t d, float sign,
                 cudaStream_t stream) {
  const int64_t total = B * S * n * (d / 2);
  if (total == 0) return;
  rope_kernel<<<grid_for(total), kThreads, 0, stream>>>(table, x, B, S, n, d, sign);
  FP_CUDA_LAUNCHED();
}

}  // namespace foldpar::cuda
