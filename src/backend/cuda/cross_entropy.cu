// Cross-entropy kernels of the CUDA backend: one block per token row for the log-sum-exp
// (forward, and the online update over vocabulary shards), one grid-stride pass for the
// gradient. Row reductions are f32; the loss sum is accumulated across rows in f64.
// Targets outside [0, V) are not checked here (validate_batch checks ids on the host).
#include "backend/cuda/cuda_common.cuh"

namespace foldpar::cuda {
namespace {

// Max and sum of exp(x - max) over one row of V logits; every thread gets both.
__device__ void row_lse(FloatPtr logits, int64_t row, int64_t V, float* smem, float* mx_out, float* sum_out) {
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, load(logits, row * V + j));
  mx = block_max(mx, smem);
  float sum = 0;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) sum += __expf(load(logits, row * V + j) - mx);
  *sum_out = block_sum(sum, smem);
  *mx_out = mx;
}

__global__ void cross_entropy_forward_kernel(FloatPtr logits, const int32_t* targets, int64_t V, int32_t ignore,
                                             FloatOut lse, double* loss) {
  __shared__ float smem[32];
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  if (t == ignore) {
    if (threadIdx.x == 0) store(lse, row, 0.0f);
    return;
  }
  float mx, sum;
  row_lse(logits, row, V, smem, &mx, &sum);
  if (threadIdx.x == 0) {
    const float l = mx + logf(sum);
    store(lse, row, l);
    atomicAdd(loss, static_cast<double>(l) - static_cast<double>(load(logits, row * V + t)));
  }
}

__global__ void cross_entropy_backward_kernel(FloatPtr logits, const int32_t* targets, FloatPtr lse, int64_t T,
                                              int64_t V, int64_t off, int32_t ignore, float scale, FloatOut dx) {
  FP_GRID_STRIDE(i, T * V) {
    const int64_t row = i / V, j = i % V;
    const int32_t t = targets[row];
    float g = 0;
    if (t != ignore) {
      const float p = __expf(load(logits, i) - load(lse, row));
      g = (p - (j + off == t ? 1.0f : 0.0f)) * scale;
    }
    store(dx, i, g);  // in place is safe: element i is read before it is written, by one thread
  }
}

__global__ void softmax_chunk_update_kernel(FloatPtr logits, const int32_t* targets, int64_t V, int64_t off,
                                            int32_t ignore, FloatOut row_max, FloatOut row_sum, FloatOut target_logit) {
  __shared__ float smem[32];
  const int64_t row = blockIdx.x;
  float cm = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) cm = fmaxf(cm, load(logits, row * V + j));
  cm = block_max(cm, smem);
  const float m_old = load(row_max, row), m_new = fmaxf(m_old, cm);
  float s = 0;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += __expf(load(logits, row * V + j) - m_new);
  s = block_sum(s, smem);
  if (threadIdx.x != 0) return;
  const float carried = m_old == -INFINITY ? 0.0f : load(row_sum, row) * __expf(m_old - m_new);
  store(row_max, row, m_new);
  store(row_sum, row, carried + s);
  const int32_t tg = targets[row];
  const int64_t t = tg - off;
  if (tg != ignore && t >= 0 && t < V) store(target_logit, row, load(logits, row * V + t));
}

__global__ void softmax_rescale_kernel(const float* local_max, const float* global_max, float* row_sum, int64_t n) {
  FP_GRID_STRIDE(i, n) row_sum[i] *= expf(local_max[i] - global_max[i]);
}

// sums[0] += lse - target_logit and sums[1] += 1 over the valid rows (f64 atomics: the
// order, and so the last bits of the sum, vary from run to run).
__global__ void cross_entropy_finish_kernel(const float* row_max, const float* row_sum, const float* target_logit,
                                            const int32_t* targets, int32_t ignore, float* lse, int64_t n,
                                            double* sums) {
  FP_GRID_STRIDE(i, n) {
    const float l = row_max[i] + logf(row_sum[i]);
    lse[i] = l;
    if (targets[i] == ignore) continue;
    atomicAdd(&sums[0], static_cast<double>(l) - static_cast<double>(target_logit[i]));
    atomicAdd(&sums[1], 1.0);
  }
}

__global__ void count_valid_kernel(const int32_t* targets, int32_t ignore, int64_t n, unsigned long long* count) {
  unsigned long long mine = 0;
  FP_GRID_STRIDE(i, n) mine += targets[i] != ignore;
  if (mine != 0) atomicAdd(count, mine);
}

}  // namespace

double cross_entropy_forward(FloatPtr logits, const int32_t* targets, int64_t T, int64_t V, int32_t ignore_index,
                             FloatOut lse, double* scratch, cudaStream_t stream) {
  cudaMemsetAsync(scratch, 0, sizeof(double), stream);
  if (T > 0) {
    cross_entropy_forward_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(logits, targets, V, ignore_index,
                                                                                     lse, scratch);
    FP_CUDA_LAUNCHED();
  }
  double loss = 0;
  cudaMemcpyAsync(&loss, scratch, sizeof(double), cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  FP_CUDA_LAUNCHED();
  return loss;
}

void launch_cross_entropy_backward(FloatPtr logits, const int32_t* targets, FloatPtr lse, int64_t T, int64_t V,
                                   int64_t vocab_offset, int32_t ignore_index, double grad_scale, FloatOut d_logits,
                                   cudaStream_t stream) {
  if (T * V == 0) return;
  cross_entropy_backward_kernel<<<grid_for(T * V), kThreads, 0, stream>>>(
      logits, targets, lse, T, V, vocab_offset, ignore_index, static_cast<float>(grad_scale), d_logits);
  FP_CUDA_LAUNCHED();
}

void launch_softmax_chunk_update(FloatPtr logits, const int32_t* targets, int64_t T, int64_t V, int64_t vocab_offset,
                                 int32_t ignore_index, FloatOut row_max, FloatOut row_sum, FloatOut target_logit,
                                 cudaStream_t stream) {
  if (T == 0) return;
  softmax_chunk_update_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(
      logits, targets, V, vocab_offset, ignore_index, row_max, row_sum, target_logit);
  FP_CUDA_LAUNCHED();
}

void launch_softmax_rescale(const float* local_max, const float* global_max, float* row_sum, int64_t n,
                            cudaStream_t stream) {
  if (n == 0) return;
  softmax_rescale_kernel<<<grid_for(n), kThreads, 0, stream>>>(local_max, global_max, row_sum, n);
  FP_CUDA_LAUNCHED();
}

void cross_entropy_finish(const float* row_max, const float* row_sum, const float* target_logit,
                          const int32_t* targets, int32_t ignore_index, float* lse, int64_t n, double* sums,
                          cudaStream_t stream) {
  cudaMemsetAsync(sums, 0, 2 * sizeof(double), stream);
  if (n > 0) {
    cross_entropy_finish_kernel<<<grid_for(n), kThreads, 0, stream>>>(row_max, row_sum, target_logit, targets,
                                                                      ignore_index, lse, n, sums);
    FP_CUDA_LAUNCHED();
  }
  cudaStreamSynchronize(stream);
  FP_CUDA_LAUNCHED();
}

int64_t count_valid_targets(const int32_t* targets, int64_t n, int32_t ignore_index, unsigned long long* scratch,
                            cudaStream_t stream) {
  cudaMemsetAsync(scratch, 0, sizeof(unsigned long long), stream);
  if (n > 0) {
    count_valid_kernel<<<grid_for(n), kThreads, 0, stream>>>(targets, ignore_index, n, scratch);
    FP_CUDA_LAUNCHED();
  }
  unsigned long long count = 0;
  cudaMemcpyAsync(&count, scratch, sizeof(count), cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  FP_CUDA_LAUNCHED();
  return static_cast<int64_t>(count);
}

}  // namespace foldpar::cuda
