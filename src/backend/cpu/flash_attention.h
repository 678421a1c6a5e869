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

namespace foldpar {

void flash_attention_forward(const AttentionDims& dims, const float* q, const float* k, const float* v,
                             const int32_t* q_pos, const int32_t* k_pos, float scale, float* out, float* lse);

// dq, dk, dv are written (not accumulated).
void flash_attention_backward(const AttentionDims& dims, const float* q, const float* k, const float* v,
                              const float* out, const float* lse, const float* d_out, const int32_t* q_pos,
                              const int32_t* k_pos, float scale, float* dq, float* dk, float* dv);

}  // namespace foldpar
