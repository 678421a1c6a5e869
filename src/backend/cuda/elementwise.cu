// Elementwise kernels of the CUDA backend: conversion/copy, add, scale, fill, sum of
// squares, AdamW and the SiLU gate. One grid-stride kernel per op; f32 arithmetic on f32
// or bf16 storage (sum of squares accumulates per thread in f32, across threads in f64).
// Fill, sum of squares and AdamW also come over many tensors in one launch (the *_many
// kernels; cuda_kernels.h has the table they walk). tests/gpu/emulation runs this file on
// the host (multi_tensor_emulation.cc).
#include <cstring>
#include <vector>

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
// One element of AdamW: the single-tensor and the many-tensor kernel share it, so their
// results are the same bit for bit.
__device__ __forceinline__ void adamw_element(const AdamWArgs& a, float weight_decay, FloatPtr grad, FloatOut param,
                                              FloatOut m, FloatOut v, int64_t i) {
  const float g = load(grad, i) * a.grad_scale;
  const float mi = a.beta1 * load(m, i) + (1 - a.beta1) * g;
  const float vi = a.beta2 * load(v, i) + (1 - a.beta2) * g * g;
  store(m, i, mi);
  store(v, i, vi);
  const float p = load(param, i);
  const float update = (mi / a.c1) / (sqrtf(vi / a.c2) + a.eps) + weight_decay * p;
  store(param, i, p - a.lr * update);
}
__global__ void adamw_kernel(AdamWArgs a, FloatPtr grad, FloatOut param, FloatOut m, FloatOut v, int64_t n) {
  FP_GRID_STRIDE(i, n) adamw_element(a, a.weight_decay, grad, param, m, v, i);
}

// ---- many tensors per launch ----
// The workspace table: block offsets begin[count + 1] (int64), then the slots (16-byte
// aligned), then, for the sum of squares, one f64 total per tensor.
struct TableLayout {
  size_t slots_at, results_at, bytes;
};
TableLayout table_layout(int64_t count, size_t slot_bytes, size_t result_bytes) {
  const auto align16 = [](size_t b) { return (b + 15) / 16 * 16; };
  TableLayout t;
  t.slots_at = align16(static_cast<size_t>(count + 1) * sizeof(int64_t));
  t.results_at = align16(t.slots_at + static_cast<size_t>(count) * slot_bytes);
  t.bytes = t.results_at + static_cast<size_t>(count) * result_bytes;
  return t;
}
// The table image on the host (results zeroed); returns the blocks of the launch.
template <typename Slot>
int64_t build_table(const Slot* slots, int64_t count, const TableLayout& t, std::vector<unsigned char>& image) {
  image.assign(t.bytes, 0);
  int64_t blocks = 0;
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(image.data() + static_cast<size_t>(i) * sizeof(int64_t), &blocks, sizeof(int64_t));
    blocks += (slots[i].n + kMultiTensorChunk - 1) / kMultiTensorChunk;
  }
  std::memcpy(image.data() + static_cast<size_t>(count) * sizeof(int64_t), &blocks, sizeof(int64_t));
  std::memcpy(image.data() + t.slots_at, slots, static_cast<size_t>(count) * sizeof(Slot));
  if (blocks > 0x7fffffff) kernel_contract_violated(__FILE__, __LINE__, "a many-tensor launch over 2^31 blocks");
  return blocks;
}
// The tensor of this block: the last t with begin[t] <= blockIdx.x (tensors without
// elements have begin[t] == begin[t + 1] and are passed over).
__device__ __forceinline__ int64_t block_tensor(const int64_t* begin, int64_t count) {
  const int64_t b = blockIdx.x;
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (begin[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}
// This block's element range [*lo, *hi) of tensor t with n elements.
__device__ __forceinline__ void block_range(const int64_t* begin, int64_t t, int64_t n, int64_t* lo, int64_t* hi) {
  *lo = (blockIdx.x - begin[t]) * kMultiTensorChunk;
  *hi = *lo + kMultiTensorChunk < n ? *lo + kMultiTensorChunk : n;
}
#define FP_BLOCK_ELEMENTS(i, lo, hi) for (int64_t i = (lo) + threadIdx.x; i < (hi); i += blockDim.x)

__global__ void fill_many_kernel(float value, const int64_t* begin, const FillSlot* slots, int64_t count) {
  const int64_t t = block_tensor(begin, count);
  const FillSlot s = slots[t];
  int64_t lo, hi;
  block_range(begin, t, s.n, &lo, &hi);
  FP_BLOCK_ELEMENTS(i, lo, hi) store(s.y, i, value);
}
__global__ void sum_squares_many_kernel(const int64_t* begin, const SumSquaresSlot* slots, int64_t count,
                                        double* totals) {
  __shared__ float smem[32];
  const int64_t t = block_tensor(begin, count);
  const SumSquaresSlot s = slots[t];
  int64_t lo, hi;
  block_range(begin, t, s.n, &lo, &hi);
  float acc = 0;
  FP_BLOCK_ELEMENTS(i, lo, hi) {
    const float v = load(s.x, i);
    acc += v * v;
  }
  // Every thread of the block is on tensor t: the block's f32 partial (kMultiTensorChunk
  // terms at most), then f64 across the tensor's blocks.
  const float total = block_sum(acc, smem);
  if (threadIdx.x == 0) atomicAdd(&totals[t], static_cast<double>(total));
}
__global__ void adamw_many_kernel(AdamWArgs a, const int64_t* begin, const AdamWSlot* slots, int64_t count) {
  const int64_t t = block_tensor(begin, count);
  const AdamWSlot s = slots[t];
  int64_t lo, hi;
  block_range(begin, t, s.n, &lo, &hi);
  // The rounded copy stores the value as param holds it (load after the store): an f32
  // master gives the f32 value, which store() rounds to bf16 as launch_convert does.
  FP_BLOCK_ELEMENTS(i, lo, hi) {
    adamw_element(a, s.weight_decay, s.grad, s.param, s.m, s.v, i);
    if (s.rounded.p != nullptr) store(s.rounded, i, load(s.param, i));
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

size_t fill_many_workspace_bytes(int64_t count) { return table_layout(count, sizeof(FillSlot), 0).bytes; }
size_t sum_squares_many_workspace_bytes(int64_t count) {
  return table_layout(count, sizeof(SumSquaresSlot), sizeof(double)).bytes;
}
size_t adamw_many_workspace_bytes(int64_t count) { return table_layout(count, sizeof(AdamWSlot), 0).bytes; }

// Each launcher: the table image on the host, one copy to the device (from pageable memory:
// the image may go as soon as the copy is enqueued), one launch.
void launch_fill_many(double value, const FillSlot* slots, int64_t count, void* workspace, cudaStream_t stream) {
  const TableLayout t = table_layout(count, sizeof(FillSlot), 0);
  std::vector<unsigned char> image;
  const int64_t blocks = build_table(slots, count, t, image);
  if (blocks == 0) return;
  unsigned char* table = static_cast<unsigned char*>(workspace);
  cudaMemcpyAsync(table, image.data(), t.bytes, cudaMemcpyDefault, stream);
  fill_many_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<float>(value), reinterpret_cast<const int64_t*>(table),
      reinterpret_cast<const FillSlot*>(table + t.slots_at), count);
  FP_CUDA_LAUNCHED();
}
void sum_squares_many(const SumSquaresSlot* slots, int64_t count, void* workspace, double* out, cudaStream_t stream) {
  const TableLayout t = table_layout(count, sizeof(SumSquaresSlot), sizeof(double));
  std::vector<unsigned char> image;
  const int64_t blocks = build_table(slots, count, t, image);
  if (blocks == 0) {
    for (int64_t i = 0; i < count; ++i) out[i] = 0;
    return;
  }
  unsigned char* table = static_cast<unsigned char*>(workspace);
  double* totals = reinterpret_cast<double*>(table + t.results_at);
  cudaMemcpyAsync(table, image.data(), t.bytes, cudaMemcpyDefault, stream);  // totals zeroed with it
  sum_squares_many_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const int64_t*>(table), reinterpret_cast<const SumSquaresSlot*>(table + t.slots_at), count,
      totals);
  FP_CUDA_LAUNCHED();
  cudaMemcpyAsync(out, totals, static_cast<size_t>(count) * sizeof(double), cudaMemcpyDefault, stream);
  cudaStreamSynchronize(stream);
  FP_CUDA_LAUNCHED();
}
void launch_adamw_many(const AdamWArgs& a, const AdamWSlot* slots, int64_t count, void* workspace,
                       cudaStream_t stream) {
  const TableLayout t = table_layout(count, sizeof(AdamWSlot), 0);
  std::vector<unsigned char> image;
  const int64_t blocks = build_table(slots, count, t, image);
  if (blocks == 0) return;
  unsigned char* table = static_cast<unsigned char*>(workspace);
  cudaMemcpyAsync(table, image.data(), t.bytes, cudaMemcpyDefault, stream);
  adamw_many_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      a, reinterpret_cast<const int64_t*>(table), reinterpret_cast<const AdamWSlot*>(table + t.slots_at), count);
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
