// Launchers of the CUDA backend's kernels, on raw device pointers. Host-callable from the
// C++ side (cuda_backend.cc), defined in the .cu files, one op family per file. Nothing
// here knows Tensor: the backend validates shapes with backend/op_checks.h and passes
// extents. Float operands are f32 or bf16 (DType says which); every kernel computes in
// f32 and accumulates reductions in f32 (sum_squares and the loss in f64). All launches
// are asynchronous on `stream`; only the launchers that return a value synchronize.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "tensor/dtype.h"

namespace foldpar::cuda {

// A float operand: f32 or bf16 storage.
struct FloatPtr {
  const void* p;
  DType dtype;
};
struct FloatOut {
  void* p;
  DType dtype;
};

// Checks cudaGetLastError after a launch (a library failure aborts; cuda_backend.cc), so
// that the .cu files need no fmt.
void check_launch(const char* file, int line);
#define FP_CUDA_LAUNCHED() ::foldpar::cuda::check_launch(__FILE__, __LINE__)
// Aborts with `what` at file:line: a launcher called against its contract (the backend
// validates first, so this is a broken invariant).
[[noreturn]] void kernel_contract_violated(const char* file, int line, const char* what);

// ---- elementwise (elementwise.cu) ----
void launch_convert(FloatPtr src, FloatOut dst, int64_t n, cudaStream_t stream);  // dst = src
void launch_add(FloatPtr x, FloatOut y, int64_t n, cudaStream_t stream);          // y += x
void launch_scale(double alpha, FloatOut y, int64_t n, cudaStream_t stream);      // y *= alpha
void launch_fill(double value, FloatOut y, int64_t n, cudaStream_t stream);
// Returns sum of x^2 (synchronizes). `scratch`: one device double.
double sum_squares(FloatPtr x, int64_t n, double* scratch, cudaStream_t stream);
struct AdamWArgs {
  float lr, beta1, beta2, eps, weight_decay, grad_scale, c1, c2;  // c1 = 1 - b1^step, c2 = 1 - b2^step
};
void launch_adamw(const AdamWArgs& a, FloatPtr grad, FloatOut param, FloatOut m, FloatOut v, int64_t n,
                  cudaStream_t stream);

// ---- many tensors in one launch (elementwise.cu) ----
// Backend::fill_many, sum_squares_many and adamw_update_many. Each tensor gets
// ceil(n / kMultiTensorChunk) blocks of kThreads threads (none when n == 0); block b finds
// its tensor t by a binary search of the block offsets (begin[t] = blocks of the tensors
// before t) and covers its elements [(b - begin[t]) * chunk, min(n, that + chunk)). The
// offsets and the per-tensor slots travel in a device table, not in kernel parameters, so
// that any number of tensors takes one launch (kernel parameters would cap a launch at a
// few hundred slots and need chunked launches): each launcher writes the table into
// `workspace` (the *_workspace_bytes of its tensor count, device memory) with one
// host-to-device copy on `stream`, then launches once; nothing at all for 0 elements.
inline constexpr int64_t kMultiTensorChunk = 4096;
struct FillSlot {
  FloatOut y;
  int64_t n;
};
struct SumSquaresSlot {
  FloatPtr x;
  int64_t n;
};
struct AdamWSlot {
  FloatPtr grad;
  FloatOut param, m, v;
  int64_t n;
  float weight_decay;  // replaces AdamWArgs::weight_decay for this tensor
  FloatOut rounded;    // p != nullptr: the updated param also stored here (a bf16 parameter of an f32 master)
};
size_t fill_many_workspace_bytes(int64_t count);
size_t sum_squares_many_workspace_bytes(int64_t count);
size_t adamw_many_workspace_bytes(int64_t count);
void launch_fill_many(double value, const FillSlot* slots, int64_t count, void* workspace, cudaStream_t stream);
// out[i] (host, count doubles) = sum of the squares of tensor i: per-block f32 partials
// added into f64 (as sum_squares). Synchronizes.
void sum_squares_many(const SumSquaresSlot* slots, int64_t count, void* workspace, double* out, cudaStream_t stream);
void launch_adamw_many(const AdamWArgs& a, const AdamWSlot* slots, int64_t count, void* workspace,
                       cudaStream_t stream);

void launch_swiglu_forward(FloatPtr gate, FloatPtr up, FloatOut out, int64_t n, cudaStream_t stream);
void launch_swiglu_backward(FloatPtr gate, FloatPtr up, FloatPtr d_out, FloatOut d_gate, FloatOut d_up, int64_t n,
                            cudaStream_t stream);

// ---- block copies (strided_copy.cu) ----
// Element offsets and row strides of Backend::copy_strided, checked by check_copy_strided.
struct StridedCopyShape {
  int64_t rows, cols;
  int64_t src_offset, src_row_stride, dst_offset, dst_row_stride;
};
// element_bytes: 1, 2, 4 or 8.
void launch_strided_copy(const void* src, void* dst, size_t element_bytes, const StridedCopyShape& s,
                         cudaStream_t stream);

// ---- embedding, RMSNorm, RoPE (norm_rope_embedding.cu) ----
// ids [T]; table [rows, h]; out [T, h].
void launch_embedding_forward(const int32_t* ids, int64_t T, FloatPtr table, int64_t rows, int64_t h,
                              int64_t vocab_offset, FloatOut out, cudaStream_t stream);
void launch_embedding_backward(const int32_t* ids, int64_t T, FloatPtr d_out, int64_t rows, int64_t h,
                               int64_t vocab_offset, FloatOut d_table, cudaStream_t stream);
// x, y [T, h]; w [h]; rstd [T].
void launch_rmsnorm_forward(FloatPtr x, FloatPtr w, double eps, int64_t T, int64_t h, FloatOut y, FloatOut rstd,
                            cudaStream_t stream);
// dx written [T, h]; dw accumulated [h]; dw_scratch: f32 workspace [h].
void launch_rmsnorm_backward(FloatPtr x, FloatPtr w, FloatPtr rstd, FloatPtr dy, int64_t T, int64_t h, FloatOut dx,
                             FloatOut dw, float* dw_scratch, cudaStream_t stream);
// x [B, S, n, d] in place; table [S, 2, d/2]; sign +1 forward, -1 backward.
void launch_rope(FloatPtr table, FloatOut x, int64_t B, int64_t S, int64_t n, int64_t d, float sign,
                 cudaStream_t stream);

// ---- cross-entropy (cross_entropy.cu) ----
// logits [T, V]; targets [T]; lse [T]. Returns the loss sum (synchronizes); `scratch`: one
// device double.
double cross_entropy_forward(FloatPtr logits, const int32_t* targets, int64_t T, int64_t V, int32_t ignore_index,
                             FloatOut lse, double* scratch, cudaStream_t stream);
void launch_cross_entropy_backward(FloatPtr logits, const int32_t* targets, FloatPtr lse, int64_t T, int64_t V,
                                   int64_t vocab_offset, int32_t ignore_index, double grad_scale, FloatOut d_logits,
                                   cudaStream_t stream);
void launch_softmax_chunk_update(FloatPtr logits, const int32_t* targets, int64_t T, int64_t V, int64_t vocab_offset,
                                 int32_t ignore_index, FloatOut row_max, FloatOut row_sum, FloatOut target_logit,
                                 cudaStream_t stream);

// row_max, row_sum, target_logit, lse: f32 [n]. row_sum *= exp(local_max - global_max).
void launch_softmax_rescale(const float* local_max, const float* global_max, float* row_sum, int64_t n,
                            cudaStream_t stream);
// lse = row_max + log(row_sum); sums (two device doubles, written): the loss sum and the
// valid count over rows whose target is not ignore_index. Synchronizes.
void cross_entropy_finish(const float* row_max, const float* row_sum, const float* target_logit,
                          const int32_t* targets, int32_t ignore_index, float* lse, int64_t n, double* sums,
                          cudaStream_t stream);
// Targets not equal to ignore_index (synchronizes); `scratch`: one device word.
int64_t count_valid_targets(const int32_t* targets, int64_t n, int32_t ignore_index, unsigned long long* scratch,
                            cudaStream_t stream);

// ---- the online-softmax merge of two partial attention results (attention_merge.cu) ----
// out, block_out [B, Sq, n_h, d] (same float dtype); lse, block_lse f32 [B, n_h, Sq].
void launch_attention_merge(FloatPtr block_out, const float* block_lse, FloatOut out, float* lse, int64_t B,
                            int64_t Sq, int64_t n_h, int64_t d, cudaStream_t stream);

// ---- causal flash attention with position arrays (flash_attention.cu) ----
struct AttentionShape {
  int64_t batch, sq, sk, n_h, n_kv, d;
  float scale;
  int64_t window = 0;  // AttentionArgs::window: key j visible iff 0 <= q_pos - k_pos < window; 0: causal
};
// q [B, Sq, n_h, d], k/v [B, Sk, n_kv, d], out like q (all the same float dtype);
// lse f32 [B, n_h, Sq]; q_pos [Sq], k_pos [Sk]. d <= kMaxHeadDim.
inline constexpr int64_t kMaxHeadDim = 256;
void launch_attention_forward(const AttentionShape& s, FloatPtr q, FloatPtr k, FloatPtr v, const int32_t* q_pos,
                              const int32_t* k_pos, FloatOut out, float* lse, cudaStream_t stream);
// delta: f32 workspace [B, n_h, Sq]. dq like q, dk/dv like k, all written.
void launch_attention_backward(const AttentionShape& s, FloatPtr q, FloatPtr k, FloatPtr v, FloatPtr out,
                               const float* lse, FloatPtr d_out, const int32_t* q_pos, const int32_t* k_pos,
                               float* delta, FloatOut dq, FloatOut dk, FloatOut dv, cudaStream_t stream);

// ---- the same on tensor cores (flash_attention_tc.cu) ----
// FlashAttention-2 style, bf16 mma.sync with f32 accumulation; same contract and outputs as
// the two launchers above (which stay the plain reference). Supported: bf16 storage and
// d in {64, 128}; every bf16 pointer 16-byte aligned (cp.async). Calling the launchers
// outside that aborts (kernel_contract_violated).
bool attention_tc_supported(const AttentionShape& s, DType dtype);
// tile_bounds: i32 workspace of attention_tc_workspace_words(s) words, written by each
// launcher before use: (min, max) position of every 64-row query tile, then key tile.
int64_t attention_tc_workspace_words(const AttentionShape& s);
void launch_attention_forward_tc(const AttentionShape& s, FloatPtr q, FloatPtr k, FloatPtr v, const int32_t* q_pos,
                                 const int32_t* k_pos, FloatOut out, float* lse, int32_t* tile_bounds,
                                 cudaStream_t stream);
// delta: f32 workspace [B, n_h, Sq] as above. dq, dk, dv written (no atomics).
void launch_attention_backward_tc(const AttentionShape& s, FloatPtr q, FloatPtr k, FloatPtr v, FloatPtr out,
                                  const float* lse, FloatPtr d_out, const int32_t* q_pos, const int32_t* k_pos,
                                  float* delta, int32_t* tile_bounds, FloatOut dq, FloatOut dk, FloatOut dv,
                                  cudaStream_t stream);

}  // namespace foldpar::cuda
