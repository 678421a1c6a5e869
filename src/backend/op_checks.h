// Argument validation shared by every backend: each op's entry point calls its check_*
// function, which FP_CHECKs shapes and dtypes and returns the extents the kernel needs.
// One validated path, so backends cannot disagree about what an op accepts.
#pragma once

#include <cstdint>

#include "backend/backend.h"

namespace foldpar {

struct MatmulDims {
  int64_t m, n, k;
  int64_t lda, ldb;  // leading dimensions of a and b as stored (row-major)
};
MatmulDims check_matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c);
// The mixed-precision product (Backend::matmul_takes_bf16): a and b bf16, c bf16 or f32.
MatmulDims check_matmul_bf16(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c);

struct AttentionDims {
  int64_t batch, sq, sk, n_h, n_kv, d;
  int64_t window = 0;  // AttentionArgs::window: 0 full causal, else keys with q_pos - k_pos < window
  int64_t group() const { return n_h / n_kv; }
};
AttentionDims check_attention(const AttentionArgs& args, const Tensor& out, const Tensor& lse);

// The scratch the CPU flash attention (backend/cpu/flash_attention.cc) takes from the
// tracked allocator once per call, in allocation order: f32 [floats], then i32 [range_ints],
// both MemCategory::kWorkspace and both live to the end of the call. Here so that the dry
// run's meta backend allocates the same bytes (the two cannot drift: the kernel sizes its
// scratch with this function).
struct AttentionScratch {
  int64_t floats = 0;
  int64_t range_ints = 0;
};
AttentionScratch cpu_flash_attention_scratch(const AttentionDims& dims, bool backward);

// The shape rules of the other ops, one per op (dtype policy, f32 only or f32/f64, stays
// with each backend). Each FP_CHECKs what Backend's comment for the op states.
void check_copy(const Tensor& src, const Tensor& dst);
// Same numel and dtype; with mixed_bf16, f32 into bf16 or bf16 into f32 too (a backend
// whose tokenwise_takes_bf16 is true).
void check_add_inplace(const Tensor& x, const Tensor& y, bool mixed_bf16 = false);
void check_adamw(const Tensor& grad, const Tensor& param, const Tensor& m, const Tensor& v);
void check_embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& out);
void check_embedding_backward(const Tensor& ids, const Tensor& d_out, const Tensor& d_table);
void check_rmsnorm_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd);
void check_rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                            const Tensor& dw);
void check_rope(const Tensor& table, const Tensor& x);  // shapes only: the table's dtype is the backend's
AttentionDims check_attention_backward(const AttentionArgs& args, const Tensor& out, const Tensor& lse,
                                       const Tensor& d_out, const Tensor& dq, const Tensor& dk, const Tensor& dv);
void check_swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out);
void check_swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, const Tensor& d_gate,
                           const Tensor& d_up);
// The three return the rows T of logits [T, V].
int64_t check_cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& lse);
int64_t check_cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& d_logits);
int64_t check_softmax_chunk_update(const Tensor& logits, const Tensor& targets, const Tensor& row_max,
                                   const Tensor& row_sum, const Tensor& target_logit);

// Rows and width of x viewed as [T, w]; checks every other tensor has the same rows/width
// as stated by the op.
int64_t rows_of(const Tensor& x);
void check_same(const Tensor& a, const Tensor& b, const char* what);
void check_float(const Tensor& t, const char* what);  // f32 or f64
void check_i32_vector(const Tensor& t, int64_t n, const char* what);

// copy_strided: same dtype, non-negative extents, both blocks inside their tensors, the
// destination's rows disjoint. Returns false when there is nothing to copy.
bool check_copy_strided(const Tensor& src, const Tensor& dst, const StridedCopy& c);
// copy_from_host / copy_to_host: the host span holds exactly the tensor's bytes.
void check_host_copy(const Tensor& t, size_t host_bytes, const char* what);

struct AttentionMergeDims {
  int64_t batch, sq, n_h, d;
};
AttentionMergeDims check_attention_merge(const Tensor& block_out, const Tensor& block_lse, const Tensor& out,
                                         const Tensor& lse);
// Row counts T of the loss pieces.
int64_t check_softmax_rescale(const Tensor& local_max, const Tensor& global_max, const Tensor& row_sum);
int64_t check_cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit,
                                   const Tensor& targets, const Tensor& lse);
// The MoE ops (Backend::moe_route_forward ...), each returning the extents its loops need.
struct MoeRouteDims {
  int64_t rows, experts, k;  // T, E, k
};
MoeRouteDims check_moe_route_forward(const Tensor& logits, const Tensor& probs, const Tensor& weights,
                                     const Tensor& experts);
MoeRouteDims check_moe_route_backward(const Backend::MoeRouteGrad& g, const Tensor& d_logits);
struct RowsDims {
  int64_t n, m, width;  // rows of the indexed side, of the listed side, row width
};
// src [N, w] -> dst [M, w] by rows i32 [M] (and scale [M]); the row ids are checked by the op.
RowsDims check_gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, const Tensor& dst);
// src [M, w] -> dst [N, w].
RowsDims check_scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, const Tensor& dst);
int64_t check_rows_dot(const Tensor& a, const Tensor& b, const Tensor& out);  // returns M
// An index row id in [0, n), checked by each backend while it reads the ids.
void check_row_id(int32_t id, int64_t n, int64_t at, const char* op);

// count_valid_targets: i32 of any shape.
void check_targets(const Tensor& targets);

}  // namespace foldpar
