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

// Rows and width of x viewed as [T, w]; checks every other tensor has the same rows/width
// as stated by the op.
int64_t rows_of(const Tensor& x);
void check_same(const Tensor& a, const Tensor& b, const char* what);
void check_float(const Tensor& t, const char* what);  // f32 or f64
void check_i32_vector(const Tensor& t, int64_t n, const char* what);

}  // namespace foldpar
