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
  int64_t group() const { return n_h / n_kv; }
};
AttentionDims check_attention(const AttentionArgs& args, const Tensor& out, const Tensor& lse);

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
// count_valid_targets: i32 of any shape.
void check_targets(const Tensor& targets);

}  // namespace foldpar
