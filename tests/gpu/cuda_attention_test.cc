// The CUDA flash attention kernels, forward and backward, against the reference backend:
// the simple kernel (contiguous causal, the zigzag position arrays of a TSP rank: two chunks
// of queries against keys gathered in rank order, GQA, Sq != Sk, head dims 16 to 128, rows
// that see no key, bf16 storage) and the tensor-core kernel (bf16, d = 64 and 128, the same
// cases at lengths that are not multiples of its tiles, unsorted key positions). Skipped
// where no GPU is visible, except the kernel-choice test, which needs none.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gpu_test_util.h"
#include "test_util.h"

namespace foldpar {
namespace {

using gpu_test::bf16_values_as_f32;
using gpu_test::kCudaBf16Op;
using gpu_test::kCudaF32Op;
using testing::near_rel;
using testing::random_tensor;

struct Case {
  const char* name;
  int64_t batch, n_h, n_kv, d;
  std::vector<int32_t> q_pos, k_pos;
  DType dtype = DType::kF32;
  int64_t window = 0;  // sliding window; 0: causal
};

std::vector<int32_t> range(int32_t lo, int32_t hi) {
  std::vector<int32_t> v;
  for (int32_t i = lo; i < hi; ++i) v.push_back(i);
  return v;
}
std::vector<int32_t> concat(std::vector<std::vector<int32_t>> parts) {
  std::vector<int32_t> v;
  for (auto& p : parts) v.insert(v.end(), p.begin(), p.end());
  return v;
}
Tensor positions(const std::vector<int32_t>& p) {
  Tensor t = Tensor::empty({static_cast<int64_t>(p.size())}, DType::kI32, MemCategory::kWorkspace);
  std::copy(p.begin(), p.end(), t.data<int32_t>());
  return t;
}

void check_case(const Case& c, Backend& ref, Backend& cuda) {
  const int64_t sq = static_cast<int64_t>(c.q_pos.size()), sk = static_cast<int64_t>(c.k_pos.size());
  const Tensor q = bf16_values_as_f32(random_tensor({c.batch, sq, c.n_h, c.d}, DType::kF32, 1));
  const Tensor k = bf16_values_as_f32(random_tensor({c.batch, sk, c.n_kv, c.d}, DType::kF32, 2));
  const Tensor v = bf16_values_as_f32(random_tensor({c.batch, sk, c.n_kv, c.d}, DType::kF32, 3));
  const Tensor d_out = bf16_values_as_f32(random_tensor({c.batch, sq, c.n_h, c.d}, DType::kF32, 4));
  const Tensor qp = positions(c.q_pos), kp = positions(c.k_pos);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  // bf16: kCudaBf16Op (2^-7) for both kernels. The tensor-core kernel also rounds P (out, dV)
  // and dS (dQ, dK) to bf16 before their second product: at most 2^-8 relative per term, but
  // of independent sign over the summed keys or queries, so it adds about 2^-8 / sqrt(3) of a
  // typical output to the output's own rounding (<= 2^-8). A host emulation of the kernel on
  // these exact cases (docs/GPU.md) measured at most 5.2e-3 against 7.8e-3.
  const double tol = c.dtype == DType::kF32 ? kCudaF32Op : kCudaBf16Op;

  const AttentionArgs ra{&q, &k, &v, &qp, &kp, scale, c.window};
  Tensor o_ref = Tensor::empty(q.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor lse_ref = Tensor::empty({c.batch, c.n_h, sq}, DType::kF32, MemCategory::kWorkspace);
  ref.attention_forward(ra, o_ref, lse_ref);
  Tensor dq_ref = Tensor::empty(q.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor dk_ref = Tensor::empty(k.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor dv_ref = Tensor::empty(v.shape(), DType::kF32, MemCategory::kWorkspace);
  ref.attention_backward(ra, o_ref, lse_ref, d_out, dq_ref, dk_ref, dv_ref);

  const Tensor qd = q.to(c.dtype, MemCategory::kWorkspace), kd = k.to(c.dtype, MemCategory::kWorkspace),
               vd = v.to(c.dtype, MemCategory::kWorkspace), dod = d_out.to(c.dtype, MemCategory::kWorkspace);
  const AttentionArgs ca{&qd, &kd, &vd, &qp, &kp, scale, c.window};
  Tensor o = Tensor::empty(q.shape(), c.dtype, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({c.batch, c.n_h, sq}, DType::kF32, MemCategory::kWorkspace);
  cuda.attention_forward(ca, o, lse);
  EXPECT_TRUE(near_rel(o, o_ref, tol)) << c.name << " out";
  // lse: -inf rows must match exactly; the rest to the f32 tolerance.
  for (int64_t i = 0; i < lse.numel(); ++i) {
    const float a = lse.data<float>()[i], b = lse_ref.data<float>()[i];
    if (std::isinf(b)) {
      EXPECT_TRUE(std::isinf(a) && a < 0) << c.name << " lse[" << i << "] = " << a << ", want -inf";
    } else {
      EXPECT_NEAR(a, b, 1e-4 * std::max(1.0f, std::abs(b))) << c.name << " lse[" << i << "]";
    }
  }
  Tensor dq = Tensor::empty(q.shape(), c.dtype, MemCategory::kWorkspace);
  Tensor dk = Tensor::empty(k.shape(), c.dtype, MemCategory::kWorkspace);
  Tensor dv = Tensor::empty(v.shape(), c.dtype, MemCategory::kWorkspace);
  // Backward from the reference's out and lse, so that only the backward is measured.
  const Tensor o_in = o_ref.to(c.dtype, MemCategory::kWorkspace);
  cuda.attention_backward(ca, o_in, lse_ref, dod, dq, dk, dv);
  EXPECT_TRUE(near_rel(dq, dq_ref, tol)) << c.name << " dq";
  EXPECT_TRUE(near_rel(dk, dk_ref, tol)) << c.name << " dk";
  EXPECT_TRUE(near_rel(dv, dv_ref, tol)) << c.name << " dv";
}

// A deterministic permutation of lo..hi-1 (a multiplicative stride coprime to the length).
std::vector<int32_t> shuffled(int32_t lo, int32_t hi) {
  const int32_t n = hi - lo;
  std::vector<int32_t> v;
  for (int32_t i = 0; i < n; ++i) v.push_back(lo + static_cast<int32_t>((int64_t{i} * 37 + 11) % n));
  return v;
}

class CudaAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    FP_REQUIRE_GPU();
    cuda_ = backend_with(AttentionKernel::kSimple);
    tc_ = backend_with(AttentionKernel::kTensorCore);
  }
  static std::unique_ptr<CudaBackend> backend_with(AttentionKernel kernel) {
    CudaBackendOptions options = gpu_test::synced_options();
    options.attention = kernel;
    return make_cuda_backend(options);
  }
  // Cases for the tensor-core kernel: bf16 storage.
  static Case bf16(Case c) {
    c.dtype = DType::kBF16;
    return c;
  }
  std::unique_ptr<Backend> ref_ = make_reference_backend();
  std::unique_ptr<CudaBackend> cuda_;  // the simple kernel, forced
  std::unique_ptr<CudaBackend> tc_;    // the tensor-core kernel, forced
};

TEST_F(CudaAttention, ContiguousCausalMultiHead) {
  check_case({"contiguous", 1, 4, 4, 16, range(0, 77), range(0, 77)}, *ref_, *cuda_);
}

TEST_F(CudaAttention, ZigzagRankOfTwoWithGqa) {
  // S = 128 in 4 chunks of 32; rank 1 of D = 2 holds chunks 1 and 2; keys gathered in rank
  // order: rank 0's chunks 0 and 3, then rank 1's.
  const Case c{"zigzag", 1, 8, 2, 64, concat({range(32, 64), range(64, 96)}),
               concat({range(0, 32), range(96, 128), range(32, 64), range(64, 96)})};
  check_case(c, *ref_, *cuda_);
  const Case c0{"zigzag rank 0", 1, 8, 2, 64, concat({range(0, 32), range(96, 128)}), c.k_pos};
  check_case(c0, *ref_, *cuda_);
}

TEST_F(CudaAttention, HeadDim128BatchTwoAndSqNotSk) {
  check_case({"d128", 2, 8, 2, 128, range(60, 160), range(0, 160)}, *ref_, *cuda_);
}

TEST_F(CudaAttention, RowsThatSeeNoKey) {
  // Queries at positions 0..9 see no key (keys start at 10): out 0, lse -inf, dq 0.
  check_case({"no key", 1, 2, 1, 32, range(0, 40), range(10, 45)}, *ref_, *cuda_);
}

TEST_F(CudaAttention, Bf16Storage) {
  Case c{"bf16 zigzag", 2, 8, 2, 128, concat({range(32, 64), range(64, 96)}),
         concat({range(0, 32), range(96, 128), range(32, 64), range(64, 96)})};
  c.dtype = DType::kBF16;
  check_case(c, *ref_, *cuda_);
}

// ---- the tensor-core kernel (forced; bf16 only) ----

TEST_F(CudaAttention, TensorCoreContiguousNotTileMultiple) {
  // 257 = 2 x 128 + 1 rows: a last forward block of one row, a last 64-tile of one row.
  check_case(bf16({"tc contiguous d64", 1, 4, 4, 64, range(0, 257), range(0, 257)}), *ref_, *tc_);
  check_case(bf16({"tc contiguous d128 gqa", 2, 8, 2, 128, range(0, 100), range(0, 100)}), *ref_, *tc_);
}

TEST_F(CudaAttention, TensorCoreZigzagWithGqa) {
  // S = 200 in 4 chunks of 50 (not a multiple of the tiles); rank 1 of D = 2 holds chunks 1
  // and 2, rank 0 chunks 0 and 3; keys gathered in rank order.
  const std::vector<int32_t> keys = concat({range(0, 50), range(150, 200), range(50, 100), range(100, 150)});
  check_case(bf16({"tc zigzag rank 1", 1, 8, 2, 128, concat({range(50, 100), range(100, 150)}), keys}), *ref_, *tc_);
  check_case(bf16({"tc zigzag rank 0", 1, 8, 2, 64, concat({range(0, 50), range(150, 200)}), keys}), *ref_, *tc_);
}

TEST_F(CudaAttention, TensorCoreQueriesSuffixOfKeys) {
  // Sq = 100 queries at positions 157..256 against Sk = 257 keys: many fully visible tiles.
  check_case(bf16({"tc suffix d128", 2, 8, 2, 128, range(157, 257), range(0, 257)}), *ref_, *tc_);
  check_case(bf16({"tc suffix d64 mha", 1, 4, 4, 64, range(157, 257), range(0, 257)}), *ref_, *tc_);
}

TEST_F(CudaAttention, TensorCoreRowsThatSeeNoKey) {
  // Queries 0..9 see no key (out 0, lse -inf, dq 0); keys 100..129 are seen by no query
  // (dk = dv = 0 must be written).
  check_case(bf16({"tc no key d64", 1, 2, 1, 64, range(0, 100), range(10, 130)}), *ref_, *tc_);
  check_case(bf16({"tc no key d128", 1, 4, 2, 128, range(0, 70), range(10, 130)}), *ref_, *tc_);
}

TEST_F(CudaAttention, TensorCoreUnsortedKeyPositions) {
  // Every key tile mixes early and late positions: masked, never skipped.
  check_case(bf16({"tc shuffled keys", 1, 4, 2, 64, range(0, 150), shuffled(0, 150)}), *ref_, *tc_);
  check_case(bf16({"tc shuffled both", 1, 2, 1, 128, shuffled(20, 170), shuffled(0, 150)}), *ref_, *tc_);
}

// Sliding windows (issue 21) on both kernels: under a tile (key tiles behind it skipped), odd
// across tiles, two keys (one would make dq and dk exactly 0, rounding compared to rounding),
// and on a zigzag shard.
TEST_F(CudaAttention, SlidingWindowBothKernels) {
  const std::vector<int32_t> keys = concat({range(0, 50), range(150, 200), range(50, 100), range(100, 150)});
  for (const int64_t window : {2, 17, 40, 97}) {
    Case plain{"window", 1, 4, 2, 64, range(0, 300), range(0, 300)};
    plain.window = window;
    check_case(plain, *ref_, *cuda_);
    check_case(bf16(plain), *ref_, *tc_);
    Case zigzag{"window zigzag rank 1", 1, 8, 2, 128, concat({range(50, 100), range(100, 150)}), keys};
    zigzag.window = window;
    check_case(zigzag, *ref_, *cuda_);
    check_case(bf16(zigzag), *ref_, *tc_);
  }
}

// The choice itself is a pure function (no GPU needed): kAuto takes the tensor cores for bf16
// at a supported head dim and aligned tensors, the simple kernel otherwise.
TEST(CudaAttentionKernelChoice, AutoPicksTensorCoresForBf16Only) {
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kAuto, DType::kBF16, 128, true), AttentionKernel::kTensorCore);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kAuto, DType::kBF16, 64, true), AttentionKernel::kTensorCore);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kAuto, DType::kF32, 128, true), AttentionKernel::kSimple);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kAuto, DType::kBF16, 32, true), AttentionKernel::kSimple);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kAuto, DType::kBF16, 128, false), AttentionKernel::kSimple);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kSimple, DType::kBF16, 128, true), AttentionKernel::kSimple);
  EXPECT_EQ(resolve_attention_kernel(AttentionKernel::kTensorCore, DType::kBF16, 128, true),
            AttentionKernel::kTensorCore);
}

}  // namespace
}  // namespace foldpar
