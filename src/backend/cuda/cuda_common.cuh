// Device helpers shared by the kernels of the CUDA backend: f32/bf16 loads and stores,
// warp and block reductions, grid sizing. Included by .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_kernels.h"

namespace foldpar::cuda {

__device__ __forceinline__ float load(FloatPtr x, int64_t i) {
  return x.dtype == DType::kBF16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(x.p)[i])
                                 : static_cast<const float*>(x.p)[i];
}
__device__ __forceinline__ float load(FloatOut x, int64_t i) {
  return x.dtype == DType::kBF16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(x.p)[i])
                                 : static_cast<const float*>(x.p)[i];
}
// Rounds to nearest even for bf16 (as f32_to_bf16 on the host does).
__device__ __forceinline__ void store(FloatOut x, int64_t i, float v) {
  if (x.dtype == DType::kBF16) {
    static_cast<__nv_bfloat16*>(x.p)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<float*>(x.p)[i] = v;
  }
}

// Key at k_pos visible to the query at q_pos under a sliding window (0: causal only).
__device__ __forceinline__ bool sees(int q_pos, int k_pos, int64_t window) {
  return k_pos <= q_pos && (window == 0 || int64_t{q_pos} - k_pos < window);
}
// Every key of positions <= k_hi behind the window of every query of positions >= q_lo.
__device__ __forceinline__ bool behind_window(int q_lo, int k_hi, int64_t window) {
  return window > 0 && int64_t{q_lo} - k_hi >= window;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum / max for blockDim.x a multiple of 32 (<= 1024); every thread gets it.
// `smem` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < warps ? smem[lane] : 0.0f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < warps ? smem[lane] : -INFINITY;
  return warp_max(v);
}

constexpr int kThreads = 256;
// Blocks for a grid-stride loop over n elements (capped; the loop covers the rest).
inline unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 * 8 ? 65535 * 8 : blocks));
}

#define FP_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); i += int64_t{gridDim.x} * blockDim.x)

}  // namespace foldpar::cuda
