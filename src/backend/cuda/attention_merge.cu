// The online-softmax merge of two partial attention results (Backend::attention_merge):
// one thread per (sequence, head, query row), its d outputs in a loop. Weights are formed
// in f64 as the CPU backends do; outputs f32 or bf16, lse f32.
#include "backend/cuda/cuda_common.cuh"

namespace foldpar::cuda {
namespace {

__global__ void attention_merge_kernel(FloatPtr block_out, const float* block_lse, FloatOut out, float* lse,
                                       int64_t B, int64_t Sq, int64_t n_h, int64_t d) {
  FP_GRID_STRIDE(li, B * n_h * Sq) {
    const int64_t i = li % Sq, h = (li / Sq) % n_h, b = li / (Sq * n_h);
    const int64_t oi = ((b * Sq + i) * n_h + h) * d;
    const float a = lse[li], c = block_lse[li];
    if (c == -INFINITY) continue;
    if (a == -INFINITY) {
      for (int64_t e = 0; e < d; ++e) store(out, oi + e, load(block_out, oi + e));
      lse[li] = c;
      continue;
    }
    const double m = fmax(static_cast<double>(a), static_cast<double>(c));
    const double ea = exp(a - m), ec = exp(c - m), s = ea + ec;
    const float wa = static_cast<float>(ea / s), wc = static_cast<float>(ec / s);
    for (int64_t e = 0; e < d; ++e) store(out, oi + e, wa * load(out, oi + e) + wc * load(block_out, oi + e));
    lse[li] = static_cast<float>(m + log(s));
  }
}

}  // namespace

void launch_attention_merge(FloatPtr block_out, const float* block_lse, FloatOut out, float* lse, int64_t B,
                            int64_t Sq, int64_t n_h, int64_t d, cudaStream_t stream) {
  const int64_t rows = B * n_h * Sq;
  if (rows == 0) return;
  attention_merge_kernel<<<grid_for(rows), kThreads, 0, stream>>>(block_out, block_lse, out, lse, B, Sq, n_h, d);
  FP_CUDA_LAUNCHED();
}

}  // namespace foldpar::cuda
