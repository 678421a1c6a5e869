// The online-softmax merge of ring attention (parallel/ring_attention.h): attention over a
// set of keys equals the merge of the attention over any partition of those keys into
// blocks, whatever the order of the blocks; blocks that show a query nothing (lse -inf)
// contribute nothing and never produce NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/tolerance.h"
#include "parallel/ring_attention.h"
#include "test_util.h"

namespace foldpar {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

Tensor positions(const std::vector<int32_t>& p) {
  Tensor t = Tensor::empty({static_cast<int64_t>(p.size())}, DType::kI32, MemCategory::kWorkspace);
  std::copy(p.begin(), p.end(), t.data<int32_t>());
  return t;
}

// Rows [begin, end) of dim 1 of a [B, S, n, d] tensor, copied.
Tensor key_rows(const Tensor& x, int64_t begin, int64_t end) {
  const int64_t B = x.dim(0), S = x.dim(1), row = x.numel() / (B * S);
  Tensor out = Tensor::empty({B, end - begin, x.dim(2), x.dim(3)}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t b = 0; b < B; ++b)
    std::copy_n(x.data<float>() + (b * S + begin) * row, (end - begin) * row,
                out.data<float>() + b * (end - begin) * row);
  return out;
}

struct MergeSizes {
  int64_t B = 2, Sq = 7, Sk = 12, n_h = 4, n_kv = 2, d = 8;
  std::vector<int32_t> q_pos{3, 4, 5, 11, 12, 13, 0};  // zigzag-like, unsorted, one sees only key 0
  std::vector<int32_t> k_pos{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
};

// Attention of q against keys [begin, end): out and lse, on the fast backend.
void attend(Backend& be, const MergeSizes& s, const Tensor& q, const Tensor& k, const Tensor& v, int64_t begin,
            int64_t end, Tensor& out, Tensor& lse) {
  const Tensor kb = key_rows(k, begin, end), vb = key_rows(v, begin, end);
  const Tensor qp = positions(s.q_pos);
  const Tensor kp = positions(std::vector<int32_t>(s.k_pos.begin() + begin, s.k_pos.begin() + end));
  out = Tensor::empty({s.B, s.Sq, s.n_h, s.d}, DType::kF32, MemCategory::kWorkspace);
  lse = Tensor::empty({s.B, s.n_h, s.Sq}, DType::kF32, MemCategory::kWorkspace);
  const AttentionArgs args{&q, &kb, &vb, &qp, &kp, 1.0 / std::sqrt(static_cast<double>(s.d))};
  be.attention_forward(args, out, lse);
}

void expect_finite(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i) ASSERT_FALSE(std::isnan(t.data<float>()[i])) << "NaN at " << i;
}

class MergeTest : public ::testing::Test {
 protected:
  MergeSizes s;
  std::unique_ptr<Backend> be = make_cpu_backend();
  Tensor q = testing::random_tensor({s.B, s.Sq, s.n_h, s.d}, DType::kF32, 1);
  Tensor k = testing::random_tensor({s.B, s.Sk, s.n_kv, s.d}, DType::kF32, 2);
  Tensor v = testing::random_tensor({s.B, s.Sk, s.n_kv, s.d}, DType::kF32, 3);

  // Merges the blocks [cuts[i], cuts[i+1]) in the given order and compares with all keys.
  void check_partition(const std::vector<int64_t>& cuts, const std::vector<int>& order) {
    Tensor ref_out, ref_lse;
    attend(*be, s, q, k, v, 0, s.Sk, ref_out, ref_lse);
    Tensor out = Tensor::zeros(ref_out.shape(), DType::kF32, MemCategory::kWorkspace);
    Tensor lse = Tensor::empty(ref_lse.shape(), DType::kF32, MemCategory::kWorkspace);
    be->fill(-INFINITY, lse);
    for (int i : order) {
      Tensor bo, bl;
      attend(*be, s, q, k, v, cuts[i], cuts[i + 1], bo, bl);
      merge_attention_block(*be, bo, bl, out, lse);
    }
    expect_finite(out);
    expect_finite(lse);
    EXPECT_LE(max_rel_error(out, ref_out), tol::kF32Op) << describe_mismatches(out, ref_out, tol::kF32Op);
    EXPECT_LE(max_rel_error(lse, ref_lse), tol::kF32Op) << describe_mismatches(lse, ref_lse, tol::kF32Op);
  }
};

TEST_F(MergeTest, TwoBlocksEqualAllKeys) { check_partition({0, 6, 12}, {0, 1}); }

TEST_F(MergeTest, BlocksInAnyOrder) {
  // The later blocks are invisible to several queries (lse -inf there) and come first.
  check_partition({0, 3, 4, 9, 12}, {3, 1, 2, 0});
}

TEST_F(MergeTest, SingleKeyBlocks) {
  std::vector<int64_t> cuts;
  std::vector<int> order;
  for (int64_t j = 0; j <= s.Sk; ++j) cuts.push_back(j);
  for (int j = static_cast<int>(s.Sk) - 1; j >= 0; --j) order.push_back(j);
  check_partition(cuts, order);
}

TEST(Merge, InfiniteSidesAreHandledExactly) {
  std::unique_ptr<Backend> be = make_cpu_backend();
  // One query, one head, d = 2, B = 1: four rows cover the four -inf cases.
  const int64_t B = 1, Sq = 4, n_h = 1, d = 2;
  Tensor out = Tensor::empty({B, Sq, n_h, d}, DType::kF32, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({B, n_h, Sq}, DType::kF32, MemCategory::kWorkspace);
  Tensor bo = Tensor::empty({B, Sq, n_h, d}, DType::kF32, MemCategory::kWorkspace);
  Tensor bl = Tensor::empty({B, n_h, Sq}, DType::kF32, MemCategory::kWorkspace);
  const float o0[] = {0, 0, 1, 2, 0, 0, 3, 4}, l0[] = {kNegInf, 0.5f, kNegInf, std::log(3.0f)};
  const float b0[] = {0, 0, 0, 0, 5, 6, 7, 8}, bl0[] = {kNegInf, kNegInf, 1.5f, std::log(1.0f)};
  std::copy_n(o0, 8, out.data<float>());
  std::copy_n(l0, 4, lse.data<float>());
  std::copy_n(b0, 8, bo.data<float>());
  std::copy_n(bl0, 4, bl.data<float>());
  merge_attention_block(*be, bo, bl, out, lse);
  const float* o = out.data<float>();
  const float* l = lse.data<float>();
  // Both -inf: nothing seen, out 0, lse -inf.
  EXPECT_EQ(o[0], 0.0f);
  EXPECT_EQ(o[1], 0.0f);
  EXPECT_EQ(l[0], kNegInf);
  // Block -inf: unchanged.
  EXPECT_EQ(o[2], 1.0f);
  EXPECT_EQ(o[3], 2.0f);
  EXPECT_EQ(l[1], 0.5f);
  // Running -inf: the block's result, exactly.
  EXPECT_EQ(o[4], 5.0f);
  EXPECT_EQ(o[5], 6.0f);
  EXPECT_EQ(l[2], 1.5f);
  // Both finite: weights 3/4 and 1/4 (sums of exponentials 3 and 1), lse = log 4.
  EXPECT_NEAR(o[6], 0.75f * 3 + 0.25f * 7, 1e-6);
  EXPECT_NEAR(o[7], 0.75f * 4 + 0.25f * 8, 1e-6);
  EXPECT_NEAR(l[3], std::log(4.0f), 1e-6);
}

}  // namespace
}  // namespace foldpar
