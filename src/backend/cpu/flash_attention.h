// Blocked ("flash") causal attention for f32 on one CPU thread (OpenBLAS sgemm for the block
// products; call with OpenBLAS single-threaded): online softmax over key blocks, never an
// Sq x Sk matrix; the backward recomputes scores from the saved log-sum-exp. Visibility is by
// explicit global positions (key j visible to query i iff k_pos[j] <= q_pos[i], in any order);
// tiles that no query can see are skipped. A query that sees no key gets out 0, lse -inf,
// dq 0. Scratch comes from the tracked allocator (MemCategory::kWorkspace), once per call:
// O(block) plus, when n_kv > 1, one kv head's K and V (backward: also dK, dV) packed
// contiguous, 2 (4) * Sk * d floats.
// Layouts: q, out, d_out, dq [B, Sq, n_h, d]; k, v, dk, dv [B, Sk, n_kv, d]; lse [B, n_h, Sq].
#pragma once

#include <cstdint>

#include "backend/op_checks.h"
#include "tensor/dtype.h"

namespace foldpar {

void flash_attention_forward(const AttentionDims& dims, const float* q, const float* k, const float* v,
                             const int32_t* q_pos, const int32_t* k_pos, float scale, float* out, float* lse);

// dq, dk, dv are written (not accumulated).
void flash_attention_backward(const AttentionDims& dims, const float* q, const float* k, const float* v,
                              const float* out, const float* lse, const float* d_out, const int32_t* q_pos,
                              const int32_t* k_pos, float scale, float* dq, float* dk, float* dv);

// The same with bf16 operands (flash_attention_bf16.cc): Q, K, V (and dO) bf16, every tile
// product bf16 x bf16 with f32 accumulation on oneDNN (gemm_bf16; call only where
// gemm_engine_report().bf16_native), P and dS rounded to bf16 as operands of the next
// product; softmax, lse and the row statistics in f32; out, dq, dk, dv rounded to bf16 once;
// lse f32 or bf16. Same layouts and scratch rules as above.
struct FlashBf16Inputs {
  const bf16 *q = nullptr, *k = nullptr, *v = nullptr;
  const int32_t *q_pos = nullptr, *k_pos = nullptr;
};
void flash_attention_forward_bf16(const AttentionDims& dims, const FlashBf16Inputs& in, float scale, bf16* out,
                                  float* lse);
void flash_attention_forward_bf16(const AttentionDims& dims, const FlashBf16Inputs& in, float scale, bf16* out,
                                  bf16* lse);
void flash_attention_backward_bf16(const AttentionDims& dims, const FlashBf16Inputs& in, const bf16* out,
                                   const float* lse, const bf16* d_out, float scale, bf16* dq, bf16* dk, bf16* dv);
void flash_attention_backward_bf16(const AttentionDims& dims, const FlashBf16Inputs& in, const bf16* out,
                                   const bf16* lse, const bf16* d_out, float scale, bf16* dq, bf16* dk, bf16* dv);

// The bf16 kernel's own need; cpu_flash_attention_scratch (op_checks.h), what both kernels
// allocate, is the larger of it and the f32 kernel's.
AttentionScratch flash_attention_bf16_scratch(const AttentionDims& d, bool backward);

}  // namespace foldpar
