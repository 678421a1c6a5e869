// Elementwise kernels of the CUDA backend: conversion/copy, add, scale, fill, sum of
// squares, AdamW and the SiLU gate. One grid-stride kernel per op; f32 arithmetic on f32
// or bf16 storage (sum of squares accumulates per thread in f32, across threads in f64).
#include "backend/cuda/cuda_common.cuh"

namespace foldpar::cuda {
namespace {

__global__ void convert_kernel(FloatPtr src, FloatOut dst, int64_t n) {
  FP_GRID_STRIDE(i, n) store(dst, i, load(src, i));
}
__global__ void add_kernel(FloatPtr x, FloatOut y, int64_t n) {
  FP_GRID_STRIDE(i, n) store(y, i, load(y, i) + load(x, i));
}
__global__ void scale_kernel(float alpha, FloatOut y, int64_t n) {
  FP_GRID_STRIDE(i, n) store(y, i, alpha * load(y, i));
}
__global__ void fill_kernel(float value, FloatOut y, int64_t n) {
  FP_GRID_STRIDE(i, n) store(y, i, value);
}
__global__ void sum_squares_kernel(FloatPtr x, int64_t n, double* out) {
  __shared__ float smem[32];
  float acc = 0;
  FP_GRID_STRIDE(i, n) {
    const float v = load(x, i);
    acc += v * v;
  }
  // Per-block partial in f32 over at most a few thousand terms, then f64 across blocks.
  const float total = block_sum(acc, smem);
  if (threadIdx.x == 0) atomicAdd(out, static_cast<double>(total));
}
__global__ void adamw_kernel(AdamWArgs a, FloatPtr grad, FloatOut param, FloatOut m, FloatOut v, int64_t n) {
  FP_GRID_STRIDE(i, n) {
    const float g = load(grad, i) * a.grad_scale;
    const float mi = a.beta1 * load(m, i) + (1 - a.beta1) * g;
    const float vi = a.beta2 * load(v, i) + (1 - a.beta2) * g * g;
    store(m, i, mi);
    store(v, i, vi);
    const float p = load(param, i);
    const float update = (mi / a.c1) / (sqrtf(vi / a.c2) + a.eps) + a.weight_decay * p;
    store(param, i, p - a.lr * update);
  }
}
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }
__global__ void swiglu_forward_kernel(FloatPtr gate, FloatPtr up, FloatOut out, int64_t n) {
  FP_GRID_STRIDE(i, n) {
    const float g = load(gate, i);
    store(out, i, g * sigmoid(g) * load(up, i));
  }
}
__global__ void swiglu_backward_kernel(FloatPtr gate, FloatPtr up, FloatPtr d_out, FloatOut d_gate, FloatOut d_up,
                                       int64_t n) {
  FP_GRID_STRIDE(i, n) {
    const float g = load(gate, i), u = load(up, i), d_o = load(d_out, i);
    const float sig = sigmoid(g);
    const float dsilu = sig * (1.0f + g * (1.0f - sig));
    store(d_up, i, d_o * g * sig);
    store(d_gate, i, d_o * u * dsilu);
  }
}

}  // namespace

void launch_convert(FloatPtr src, FloatOut dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  convert_kernel<<<grid_for(n), kThreads, 0, stream>>>(src, dst, n);
  FP_CUDA_LAUNCHED();
}
void launch_add(FloatPtr x, FloatOut y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  add_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, y, n);
  FP_CUDA_LAUNCHED();
}
void launch_scale(double alpha, FloatOut y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  scale_kernel<<<grid_for(n), kThreads, 0, stream>>>(static_cast<float>(alpha), y, n);
  FP_CUDA_LAUNCHED();
}
void launch_fill(double value, FloatOut y, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  fill_kernel<<<grid_for(n), kThreads, 0, stream>>>(static_cast<float>(value), y, n);
  FP_CUDA_LAUNCHED();
}
double sum_squares(FloatPtr x, int64_t n, double* scratch, cudaStream_t stream) {
  cudaMemsetAsync(scratch, 0, sizeof(double), stream);
  if (n > 0) {
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    sum_squares_kernel<<<static_cast<unsigned>(blocks < 1024 ? blocks : 1024), kThreads, 0, stream>>>(x, n, scratch);
    FP_CUDA_LAUNCHED();
  }
  double result = 0;
  cudaMemcpyAsync(&result, scratch, sizeof(double), cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  FP_CUDA_LAUNCHED();
  return result;
}
void launch_adamw(const AdamWArgs& a, FloatPtr grad, FloatOut param, FloatOut m, FloatOut v, int64_t n,
                  cudaStream_t stream) {
  if (n == 0) return;
  adamw_kernel<<<grid_for(n), kThreads, 0, stream>>>(a, grad, param, m, v, n);
  FP_CUDA_LAUNCHED();
}
void launch_swiglu_forward(FloatPtr gate, FloatPtr up, FloatOut out, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  swiglu_forward_kernel<<<grid_for(n), kThreads, 0, stream>>>(gate, up, out, n);
  FP_CUDA_LAUNCHED();
}
void launch_swiglu_backward(FloatPtr gate, FloatPtr up, FloatPtr d_out, FloatOut d_gate, FloatOut d_up, int64_t n,
                            cudaStream_t stream) {
  if (n == 0) return;
  swiglu_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(gate, up, d_out, d_gate, d_up, n);
  FP_CUDA_LAUNCHED();
}

}  // namespace foldpar::cuda
