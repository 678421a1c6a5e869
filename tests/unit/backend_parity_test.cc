// Every fast CPU op against the reference backend (fp64 accumulation), forward and backward,
// on awkward sizes. Attention has its own, larger harness in flash_attention_test.cc.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "backend/backend.h"
#include "backend/rope_table.h"
#include "core/tolerance.h"
#include "test_util.h"

namespace foldpar {
namespace {

using testing::near_rel;
using testing::random_tensor;

class BackendParity : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> fast_ = make_cpu_backend();
  std::unique_ptr<Backend> ref_ = make_reference_backend();
  static Tensor like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), MemCategory::kWorkspace); }
};

TEST_F(BackendParity, MatmulAllTransposesAndBeta) {
  struct Case { int64_t m, n, k; };
  // m <= 4 with a not transposed takes the skinny path (decode): rows in pairs plus a lone
  // one (m = 3), weight rows in blocks of 4 with a tail (n = 6, 37), k in vectors of 8 with
  // a tail (k = 9, 17, 515 = 64 x 8 + 3).
  for (Case c : {Case{1, 1, 1}, Case{7, 13, 5}, Case{64, 33, 129}, Case{3, 200, 17}, Case{1, 64, 515},
                 Case{4, 37, 515}, Case{2, 6, 9}, Case{5, 9, 48}}) {
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        Tensor a = random_tensor(ta ? Shape{c.k, c.m} : Shape{c.m, c.k}, DType::kF32, 1);
        Tensor b = random_tensor(tb ? Shape{c.n, c.k} : Shape{c.k, c.n}, DType::kF32, 2);
        Tensor c0 = random_tensor({c.m, c.n}, DType::kF32, 3);
        for (float beta : {0.0f, 1.0f, 0.5f}) {
          Tensor got = c0.clone(MemCategory::kWorkspace), want = c0.clone(MemCategory::kWorkspace);
          fast_->matmul(a, ta, b, tb, got, 0.75f, beta);
          ref_->matmul(a, ta, b, tb, want, 0.75f, beta);
          EXPECT_TRUE(near_rel(got, want, tol::kF32Op)) << c.m << "x" << c.n << "x" << c.k << " ta=" << ta
                                                        << " tb=" << tb << " beta=" << beta;
        }
      }
  }
}

TEST_F(BackendParity, MatmulBetaZeroIgnoresNaN) {
  Tensor a = random_tensor({4, 3}, DType::kF32, 1), b = random_tensor({3, 5}, DType::kF32, 2);
  Tensor c = Tensor::empty({4, 5}, DType::kF32, MemCategory::kWorkspace);
  fast_->fill(std::numeric_limits<double>::quiet_NaN(), c);
  fast_->matmul(a, false, b, false, c);
  for (int64_t i = 0; i < c.numel(); ++i) EXPECT_FALSE(std::isnan(c.data<float>()[i]));
  // The skinny path with b transposed (4 rows), and sgemm (5 rows).
  for (int64_t m : {4, 5}) {
    Tensor a2 = random_tensor({m, 3}, DType::kF32, 1), bt = random_tensor({5, 3}, DType::kF32, 2);
    Tensor c2 = Tensor::empty({m, 5}, DType::kF32, MemCategory::kWorkspace);
    fast_->fill(std::numeric_limits<double>::quiet_NaN(), c2);
    fast_->matmul(a2, false, bt, true, c2);
    for (int64_t i = 0; i < c2.numel(); ++i) EXPECT_FALSE(std::isnan(c2.data<float>()[i])) << m;
  }
}

TEST_F(BackendParity, RmsNormForwardBackward) {
  for (int64_t rows : {1, 5, 64}) {
    // h >= 7: at h = 1 the exact dx is ~0 (y = sign(x) w), and a normwise comparison of a
    // cancellation residue measures nothing.
    for (int64_t h : {7, 64, 512}) {
      Tensor x = random_tensor({rows, h}, DType::kF32, 4, 3.0);
      Tensor w = random_tensor({h}, DType::kF32, 5);
      Tensor dy = random_tensor({rows, h}, DType::kF32, 6);
      Tensor y1 = like(x), y2 = like(x);
      Tensor r1 = Tensor::empty({rows}, DType::kF32, MemCategory::kWorkspace), r2 = like(r1);
      fast_->rmsnorm_forward(x, w, 1e-5, y1, r1);
      ref_->rmsnorm_forward(x, w, 1e-5, y2, r2);
      EXPECT_TRUE(near_rel(y1, y2, tol::kF32Op));
      EXPECT_TRUE(near_rel(r1, r2, tol::kF32Op));
      Tensor dx1 = like(x), dx2 = like(x);
      Tensor dw1 = random_tensor({h}, DType::kF32, 7), dw2 = dw1.clone(MemCategory::kWorkspace);
      fast_->rmsnorm_backward(x, w, r2, dy, dx1, dw1);
      ref_->rmsnorm_backward(x, w, r2, dy, dx2, dw2);
      EXPECT_TRUE(near_rel(dx1, dx2, tol::kF32Op)) << rows << "x" << h;
      EXPECT_TRUE(near_rel(dw1, dw2, tol::kF32Op)) << rows << "x" << h;
    }
  }
}

TEST_F(BackendParity, RopeAtNonContiguousPositions) {
  // Zigzag-like positions: two chunks far apart, plus a large position.
  std::vector<int32_t> pos = {0, 1, 2, 61, 62, 63, 30000};
  for (int64_t d : {2, 8, 128}) {
    Tensor table = build_rope_table(*make_reference_backend(), pos, d, 10000.0, DType::kF32);
    Tensor x = random_tensor({2, static_cast<int64_t>(pos.size()), 3, d}, DType::kF32, 8);
    Tensor a = x.clone(MemCategory::kWorkspace), b = x.clone(MemCategory::kWorkspace);
    fast_->rope_forward(table, a);
    ref_->rope_forward(table, b);
    EXPECT_TRUE(near_rel(a, b, tol::kF32Op));
    fast_->rope_backward(table, a);  // the transpose of a rotation is its inverse
    EXPECT_TRUE(near_rel(a, x, tol::kF32Op)) << "d=" << d;
    ref_->rope_backward(table, b);
    EXPECT_TRUE(near_rel(b, x, tol::kF32Op));
  }
}

TEST_F(BackendParity, RopeMatchesHuggingFaceAngles) {
  // HF: out[i] = x[i] cos - x[i + d/2] sin, with angle = pos * theta^(-2i/d).
  std::vector<int32_t> pos = {5};
  const int64_t d = 4;
  Tensor table = build_rope_table(*make_reference_backend(), pos, d, 100.0, DType::kF64);
  Tensor x = random_tensor({1, 1, 1, d}, DType::kF64, 9);
  Tensor y = x.clone(MemCategory::kWorkspace);
  ref_->rope_forward(table, y);
  const double* X = x.data<double>();
  for (int64_t i = 0; i < d / 2; ++i) {
    const double ang = 5.0 * std::pow(100.0, -2.0 * i / d);
    EXPECT_NEAR(y.data<double>()[i], X[i] * std::cos(ang) - X[i + 2] * std::sin(ang), 1e-14);
    EXPECT_NEAR(y.data<double>()[i + 2], X[i + 2] * std::cos(ang) + X[i] * std::sin(ang), 1e-14);
  }
}

TEST_F(BackendParity, SwigluForwardBackward) {
  for (int64_t n : {1, 15, 1376}) {
    Tensor g = random_tensor({3, n}, DType::kF32, 10, 4.0), u = random_tensor({3, n}, DType::kF32, 11);
    Tensor dout = random_tensor({3, n}, DType::kF32, 12);
    Tensor o1 = like(g), o2 = like(g);
    fast_->swiglu_forward(g, u, o1);
    ref_->swiglu_forward(g, u, o2);
    EXPECT_TRUE(near_rel(o1, o2, tol::kF32Op));
    Tensor dg1 = like(g), dg2 = like(g), du1 = like(g), du2 = like(g);
    fast_->swiglu_backward(g, u, dout, dg1, du1);
    ref_->swiglu_backward(g, u, dout, dg2, du2);
    EXPECT_TRUE(near_rel(dg1, dg2, tol::kF32Op));
    EXPECT_TRUE(near_rel(du1, du2, tol::kF32Op));
  }
}

TEST_F(BackendParity, EmbeddingWithVocabularyShard) {
  Tensor table = random_tensor({6, 5}, DType::kF32, 13);  // rows 10..15 of a larger vocabulary
  Tensor ids = testing::i32_tensor({5}, {10, 3, 15, 10, 12});
  Tensor o1 = Tensor::zeros({5, 5}, DType::kF32, MemCategory::kWorkspace), o2 = o1.clone(MemCategory::kWorkspace);
  fast_->embedding_forward(ids, table, 10, o1);
  ref_->embedding_forward(ids, table, 10, o2);
  EXPECT_TRUE(near_rel(o1, o2, 0.0));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(o1.data<float>()[5 + i], 0.0f);  // id 3 is not in the shard
  EXPECT_EQ(o1.data<float>()[0], table.data<float>()[0]);
  Tensor dout = random_tensor({5, 5}, DType::kF32, 14);
  Tensor d1 = random_tensor({6, 5}, DType::kF32, 15), d2 = d1.clone(MemCategory::kWorkspace);
  fast_->embedding_backward(ids, dout, 10, d1);
  ref_->embedding_backward(ids, dout, 10, d2);
  EXPECT_TRUE(near_rel(d1, d2, tol::kF32Op));
}

TEST_F(BackendParity, CrossEntropyWithIgnoredTargets) {
  for (int64_t V : {1, 3, 256, 1000}) {
    Tensor logits = random_tensor({4, V}, DType::kF32, 16, 5.0);
    Tensor tg = testing::i32_tensor({4}, {0, -100, static_cast<int32_t>(V - 1), static_cast<int32_t>(V / 2)});
    Tensor l1 = Tensor::empty({4}, DType::kF32, MemCategory::kWorkspace), l2 = like(l1);
    const double s1 = fast_->cross_entropy_forward(logits, tg, -100, l1);
    const double s2 = ref_->cross_entropy_forward(logits, tg, -100, l2);
    EXPECT_NEAR(s1, s2, tol::kF32Op * std::max(1.0, std::abs(s2)));
    EXPECT_TRUE(near_rel(l1, l2, tol::kF32Op));
    EXPECT_EQ(make_reference_backend()->count_valid_targets(tg, -100), 3);
    Tensor d1 = like(logits), d2 = like(logits);
    fast_->cross_entropy_backward(logits, tg, l2, 0, -100, 1.0 / 3, d1);
    ref_->cross_entropy_backward(logits, tg, l2, 0, -100, 1.0 / 3, d2);
    EXPECT_TRUE(near_rel(d1, d2, tol::kF32Op)) << "V=" << V;
    // In place (d_logits aliasing logits) gives the same.
    Tensor inplace = logits.clone(MemCategory::kWorkspace);
    fast_->cross_entropy_backward(inplace, tg, l2, 0, -100, 1.0 / 3, inplace);
    EXPECT_TRUE(near_rel(inplace, d2, tol::kF32Op));
    for (int64_t j = 0; j < V; ++j) EXPECT_EQ(d1.data<float>()[V + j], 0.0f);  // ignored row
  }
}

TEST_F(BackendParity, AdamWMatchesTheReferenceAndTheFormula) {
  Tensor g = random_tensor({1000}, DType::kF32, 20), p0 = random_tensor({1000}, DType::kF32, 21);
  Tensor m0 = random_tensor({1000}, DType::kF32, 22, 0.1), v0 = random_tensor({1000}, DType::kF32, 23);
  for (int64_t i = 0; i < 1000; ++i) v0.data<float>()[i] = std::abs(v0.data<float>()[i]);  // second moments >= 0
  Backend::AdamWStep s;
  s.lr = 1e-3;
  s.weight_decay = 0.1;
  s.grad_scale = 0.5;
  s.step = 3;
  Tensor p1 = p0.clone(MemCategory::kWorkspace), m1 = m0.clone(MemCategory::kWorkspace), v1 = v0.clone(MemCategory::kWorkspace);
  Tensor p2 = p0.clone(MemCategory::kWorkspace), m2 = m0.clone(MemCategory::kWorkspace), v2 = v0.clone(MemCategory::kWorkspace);
  fast_->adamw_update(s, g, p1, m1, v1);
  ref_->adamw_update(s, g, p2, m2, v2);
  EXPECT_TRUE(near_rel(p1, p2, tol::kF32Op));
  EXPECT_TRUE(near_rel(m1, m2, tol::kF32Op));
  EXPECT_TRUE(near_rel(v1, v2, tol::kF32Op));
  // Element 7 by hand.
  const double gi = g.data<float>()[7] * 0.5, mi = 0.9 * m0.data<float>()[7] + 0.1 * gi;
  const double vi = 0.95 * v0.data<float>()[7] + 0.05 * gi * gi;
  const double want = p0.data<float>()[7] - 1e-3 * ((mi / (1 - 0.729)) / (std::sqrt(vi / (1 - std::pow(0.95, 3))) + 1e-8) +
                                                     0.1 * p0.data<float>()[7]);
  EXPECT_NEAR(p2.data<float>()[7], want, 1e-6);
}

TEST_F(BackendParity, ElementwiseAndSumSquares) {
  Tensor x = random_tensor({1000, 3}, DType::kF32, 17), y = random_tensor({3000}, DType::kF32, 18);
  Tensor y1 = y.clone(MemCategory::kWorkspace), y2 = y.clone(MemCategory::kWorkspace);
  fast_->add_inplace(x, y1);
  ref_->add_inplace(x, y2);
  EXPECT_TRUE(near_rel(y1, y2, 0.0));
  fast_->scale_inplace(-0.5, y1);
  ref_->scale_inplace(-0.5, y2);
  EXPECT_TRUE(near_rel(y1, y2, 0.0));
  EXPECT_NEAR(fast_->sum_squares(x), ref_->sum_squares(x), tol::kF32Op * ref_->sum_squares(x));
}

TEST_F(BackendParity, CrossEntropyOverVocabularyShardsMatchesFull) {
  // Three shards of a vocabulary of 12: the online log-sum-exp and the per-shard backward
  // must reproduce the full cross-entropy, on both backends.
  const int64_t V = 12, Vc = 4, T = 5;
  Tensor logits = random_tensor({T, V}, DType::kF32, 19, 4.0);
  Tensor tg = testing::i32_tensor({T}, {0, 11, -100, 5, 7});
  Tensor lse_full = Tensor::empty({T}, DType::kF32, MemCategory::kWorkspace);
  const double loss_full = ref_->cross_entropy_forward(logits, tg, -100, lse_full);
  Tensor d_full = like(logits);
  ref_->cross_entropy_backward(logits, tg, lse_full, 0, -100, 0.25, d_full);
  for (Backend* be : {fast_.get(), ref_.get()}) {
    Tensor m = Tensor::empty({T}, DType::kF32, MemCategory::kWorkspace), s = like(m), tl = like(m);
    be->fill(-std::numeric_limits<double>::infinity(), m);
    be->fill(0.0, s);
    be->fill(0.0, tl);
    std::vector<Tensor> chunks;
    for (int64_t c = 0; c < V / Vc; ++c) {
      Tensor chunk = Tensor::empty({T, Vc}, DType::kF32, MemCategory::kWorkspace);
      for (int64_t r = 0; r < T; ++r)
        for (int64_t j = 0; j < Vc; ++j) chunk.data<float>()[r * Vc + j] = logits.data<float>()[r * V + c * Vc + j];
      be->softmax_chunk_update(chunk, tg, c * Vc, -100, m, s, tl);
      chunks.push_back(chunk);
    }
    Tensor lse = like(m);
    double loss = 0;
    for (int64_t r = 0; r < T; ++r) {
      lse.data<float>()[r] = m.data<float>()[r] + std::log(s.data<float>()[r]);
      if (tg.data<int32_t>()[r] != -100) loss += lse.data<float>()[r] - tl.data<float>()[r];
    }
    EXPECT_NEAR(loss, loss_full, tol::kF32Op * loss_full) << be->name();
    for (int64_t c = 0; c < V / Vc; ++c) {
      Tensor d = like(chunks[c]);
      be->cross_entropy_backward(chunks[c], tg, lse_full, c * Vc, -100, 0.25, d);
      for (int64_t r = 0; r < T; ++r)
        for (int64_t j = 0; j < Vc; ++j)
          EXPECT_NEAR(d.data<float>()[r * Vc + j], d_full.data<float>()[r * V + c * Vc + j], 1e-6)
              << be->name() << " row " << r << " col " << c * Vc + j;
    }
  }
}

}  // namespace
}  // namespace foldpar
