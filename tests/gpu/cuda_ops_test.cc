// Every CUDA op except attention (cuda_attention_test.cc) against the reference backend,
// on random inputs and awkward sizes: in f32, and with bf16 storage (the reference then
// runs in f32 on the same bf16-representable values). Skipped where no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "backend/rope_table.h"
#include "gpu_test_util.h"
#include "test_util.h"

namespace foldpar {
namespace {

using gpu_test::bf16_values_as_f32;
using gpu_test::kCudaBf16Op;
using gpu_test::kCudaF32Op;
using gpu_test::to_bf16;
using testing::near_rel;
using testing::random_tensor;

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    FP_REQUIRE_GPU();
    cuda_ = make_cuda_backend(gpu_test::synced_options());
  }
  static Tensor like(const Tensor& t, DType dtype) { return Tensor::empty(t.shape(), dtype, MemCategory::kWorkspace); }
  static Tensor ids(int64_t n, int32_t lo, int32_t hi, uint64_t seed) {
    Tensor t = Tensor::empty({n}, DType::kI32, MemCategory::kWorkspace);
    for (int64_t i = 0; i < n; ++i) t.data<int32_t>()[i] = lo + static_cast<int32_t>((i * 7919 + seed * 31) % (hi - lo));
    return t;
  }
  std::unique_ptr<Backend> ref_ = make_reference_backend();
  std::unique_ptr<CudaBackend> cuda_;
};

TEST_F(CudaOps, MatmulF32AllTransposesAndBeta) {
  struct Case { int64_t m, n, k; };
  for (Case c : {Case{1, 1, 1}, Case{7, 13, 5}, Case{64, 33, 129}, Case{3, 200, 17}, Case{130, 70, 515}}) {
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        Tensor a = random_tensor(ta ? Shape{c.k, c.m} : Shape{c.m, c.k}, DType::kF32, 1);
        Tensor b = random_tensor(tb ? Shape{c.n, c.k} : Shape{c.k, c.n}, DType::kF32, 2);
        Tensor c0 = random_tensor({c.m, c.n}, DType::kF32, 3);
        for (float beta : {0.0f, 1.0f, 0.5f}) {
          Tensor got = c0.clone(MemCategory::kWorkspace), want = c0.clone(MemCategory::kWorkspace);
          cuda_->matmul(a, ta, b, tb, got, 0.75f, beta);
          ref_->matmul(a, ta, b, tb, want, 0.75f, beta);
          EXPECT_TRUE(near_rel(got, want, kCudaF32Op)) << c.m << "x" << c.n << "x" << c.k << " ta=" << ta
                                                       << " tb=" << tb << " beta=" << beta;
        }
      }
  }
}

// bf16 operands, f32 accumulation, accumulated into c (beta = 1): a bf16 c, and an f32 c
// (the weight gradients of bf16 weights, which stay f32: the first GPU run's `train
// --device cuda` stopped on that shape check). Inputs exactly representable in bf16, so an
// f32 c differs from the reference only in summation order (the f32 tolerance).
TEST_F(CudaOps, MatmulBf16AccumulatesInF32) {
  for (DType out : {DType::kBF16, DType::kF32})
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const int64_t m = 96, n = 80, k = 1000;
        Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, DType::kF32, 4);
        Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, DType::kF32, 5);
        Tensor c0 = random_tensor({m, n}, DType::kF32, 6);
        Tensor want = bf16_values_as_f32(c0);
        ref_->matmul(bf16_values_as_f32(a), ta, bf16_values_as_f32(b), tb, want, 1.0f, 1.0f);
        Tensor got = out == DType::kBF16 ? to_bf16(c0) : bf16_values_as_f32(c0);
        cuda_->matmul(to_bf16(a), ta, to_bf16(b), tb, got, 1.0f, 1.0f);
        EXPECT_TRUE(near_rel(got, want, out == DType::kBF16 ? kCudaBf16Op : kCudaF32Op))
            << dtype_name(out) << " c, ta=" << ta << " tb=" << tb;
      }
}

TEST_F(CudaOps, ElementwiseAndSumSquares) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const double tol = dt == DType::kF32 ? kCudaF32Op : kCudaBf16Op;
    Tensor x32 = bf16_values_as_f32(random_tensor({1003}, DType::kF32, 7));
    Tensor y32 = bf16_values_as_f32(random_tensor({1003}, DType::kF32, 8));
    Tensor x = x32.to(dt, MemCategory::kWorkspace), y = y32.to(dt, MemCategory::kWorkspace);
    Tensor want = y32.clone(MemCategory::kWorkspace);
    ref_->add_inplace(x32, want);
    ref_->scale_inplace(-0.3, want);
    cuda_->add_inplace(x, y);
    cuda_->scale_inplace(-0.3, y);
    EXPECT_TRUE(near_rel(y, want, tol)) << dtype_name(dt);
    EXPECT_NEAR(cuda_->sum_squares(x), ref_->sum_squares(x32), 1e-5 * ref_->sum_squares(x32)) << dtype_name(dt);
    Tensor filled = like(x, dt);
    cuda_->fill(1.5, filled);
    for (int64_t i = 0; i < filled.numel(); ++i) {
      const float v = dt == DType::kF32 ? filled.data<float>()[i] : bf16_to_f32(filled.data<bf16>()[i]);
      ASSERT_EQ(v, 1.5f) << i;
    }
    // copy converts between f32 and bf16 (rounding to nearest even, as Tensor::to does).
    Tensor conv = like(x, dt == DType::kF32 ? DType::kBF16 : DType::kF32);
    cuda_->copy(x, conv);
    EXPECT_EQ(max_rel_error(conv, x32), 0.0) << dtype_name(dt);
  }
}

TEST_F(CudaOps, AdamWMatchesTheReference) {
  Backend::AdamWStep s;
  s.lr = 1e-2;
  s.weight_decay = 0.1;
  s.grad_scale = 0.5;
  s.step = 3;
  Tensor g = random_tensor({777}, DType::kF32, 9);
  Tensor p_ref = random_tensor({777}, DType::kF32, 10), m_ref = random_tensor({777}, DType::kF32, 11, 0.1);
  Tensor v_ref = random_tensor({777}, DType::kF32, 12, 0.1);
  for (int64_t i = 0; i < v_ref.numel(); ++i) v_ref.data<float>()[i] = std::abs(v_ref.data<float>()[i]);
  Tensor p = p_ref.clone(MemCategory::kWorkspace), m = m_ref.clone(MemCategory::kWorkspace),
         v = v_ref.clone(MemCategory::kWorkspace);
  ref_->adamw_update(s, g, p_ref, m_ref, v_ref);
  cuda_->adamw_update(s, g, p, m, v);
  EXPECT_TRUE(near_rel(p, p_ref, kCudaF32Op));
  EXPECT_TRUE(near_rel(m, m_ref, kCudaF32Op));
  EXPECT_TRUE(near_rel(v, v_ref, kCudaF32Op));
}

// The many-tensor ops (one launch each) against the single-tensor ops on the GPU: fill and
// AdamW exactly (the kernels share their element code), the sums of squares within f32
// rounding of the block partials. Sizes around the 4096-element block chunk, empty tensors,
// f32 and bf16 in one call, and a table of 1500 tensors.
TEST_F(CudaOps, ManyTensorOpsMatchTheSingleTensorOps) {
  std::vector<int64_t> sizes = {0, 1, 4095, 4096, 4097, 300, 9000, 0, 1, 8193, 100000};
  for (int i = 0; i < 1500; ++i) sizes.push_back(i % 37);
  auto dtype_at = [](size_t i) { return i % 3 == 1 ? DType::kBF16 : DType::kF32; };
  std::vector<Tensor> a, b, grads, pa, pb, ma, mb, va, vb;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const DType dt = dtype_at(i);
    Tensor x = random_tensor({sizes[i]}, DType::kF32, 100 + i).to(dt, MemCategory::kWorkspace);
    a.push_back(x);
    b.push_back(x.clone(MemCategory::kWorkspace));
    grads.push_back(random_tensor({sizes[i]}, DType::kF32, 5000 + i).to(dt, MemCategory::kWorkspace));
    Tensor p = random_tensor({sizes[i]}, DType::kF32, 9000 + i), m = random_tensor({sizes[i]}, DType::kF32, 13000 + i, 0.1);
    Tensor v = random_tensor({sizes[i]}, DType::kF32, 17000 + i, 0.1);
    for (int64_t j = 0; j < v.numel(); ++j) v.data<float>()[j] = std::abs(v.data<float>()[j]);
    pa.push_back(p);
    pb.push_back(p.clone(MemCategory::kWorkspace));
    ma.push_back(m);
    mb.push_back(m.clone(MemCategory::kWorkspace));
    va.push_back(v);
    vb.push_back(v.clone(MemCategory::kWorkspace));
  }
  // Sums of squares, before anything is overwritten.
  std::vector<const Tensor*> xs;
  for (const Tensor& t : a) xs.push_back(&t);
  std::vector<double> sums(xs.size(), -1);
  cuda_->sum_squares_many(xs, sums);
  for (size_t i = 0; i < xs.size(); ++i) {
    const double want = cuda_->sum_squares(a[i]);
    ASSERT_NEAR(sums[i], want, 1e-6 * want) << "tensor " << i << " of " << sizes[i];
  }
  // fill
  std::vector<Tensor*> ys;
  for (Tensor& t : a) ys.push_back(&t);
  cuda_->fill_many(-0.7, ys);
  for (Tensor& t : b) cuda_->fill(-0.7, t);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(max_rel_error(a[i], b[i]), 0.0) << "fill tensor " << i;
  // AdamW: bf16 gradients on f32 masters, as the optimizer calls it; decay on every other;
  // where the gradient is bf16, the master rounded into a bf16 parameter in the same launch
  // (against adamw_update then copy).
  Backend::AdamWStep s;
  s.lr = 1e-2;
  s.weight_decay = 0.1;
  s.grad_scale = 0.5;
  s.step = 3;
  std::vector<Backend::AdamWTensors> ts;
  std::vector<Tensor> ra, rb;
  for (size_t i = 0; i < sizes.size(); ++i) {
    ra.push_back(Tensor::zeros({sizes[i]}, DType::kBF16, MemCategory::kWorkspace));
    rb.push_back(Tensor::zeros({sizes[i]}, DType::kBF16, MemCategory::kWorkspace));
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    const bool round = dtype_at(i) == DType::kBF16;
    ts.push_back({&grads[i], &pa[i], &ma[i], &va[i], i % 2 == 0, round ? &ra[i] : nullptr});
    Backend::AdamWStep si = s;
    if (i % 2 != 0) si.weight_decay = 0;
    cuda_->adamw_update(si, grads[i], pb[i], mb[i], vb[i]);
    if (round) cuda_->copy(pb[i], rb[i]);
  }
  cuda_->adamw_update_many(s, ts);
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_EQ(max_rel_error(pa[i], pb[i]), 0.0) << "adamw param " << i;
    ASSERT_EQ(max_rel_error(ma[i], mb[i]), 0.0) << "adamw m " << i;
    ASSERT_EQ(max_rel_error(va[i], vb[i]), 0.0) << "adamw v " << i;
    ASSERT_EQ(max_rel_error(ra[i], rb[i]), 0.0) << "adamw rounded " << i;
  }
}

TEST_F(CudaOps, EmbeddingWithVocabularyShard) {
  const int64_t T = 37, V_local = 19, h = 45, off = 10;
  Tensor id = ids(T, 0, 40, 1);  // some ids fall outside [10, 29)
  Tensor table = random_tensor({V_local, h}, DType::kF32, 13);
  Tensor out0 = random_tensor({T, h}, DType::kF32, 14);
  Tensor got = out0.clone(MemCategory::kWorkspace), want = out0.clone(MemCategory::kWorkspace);
  ref_->embedding_forward(id, table, off, want);
  cuda_->embedding_forward(id, table, off, got);
  EXPECT_EQ(max_rel_error(got, want), 0.0);  // a copy: exact
  Tensor d_out = random_tensor({T, h}, DType::kF32, 15);
  Tensor dt_ref = random_tensor({V_local, h}, DType::kF32, 16), dt = dt_ref.clone(MemCategory::kWorkspace);
  ref_->embedding_backward(id, d_out, off, dt_ref);
  cuda_->embedding_backward(id, d_out, off, dt);
  EXPECT_TRUE(near_rel(dt, dt_ref, kCudaF32Op));
  // bf16 forward is a copy of bf16 rows: exact too. (bf16 backward accumulates with bf16
  // atomics, one rounding per token: only f32 gradients are used in training.)
  Tensor got16 = to_bf16(out0), want16 = bf16_values_as_f32(out0);
  cuda_->embedding_forward(id, to_bf16(table), off, got16);
  ref_->embedding_forward(id, bf16_values_as_f32(table), off, want16);
  EXPECT_EQ(max_rel_error(got16, want16), 0.0);
}

TEST_F(CudaOps, RmsNormForwardBackward) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const double tol = dt == DType::kF32 ? kCudaF32Op : kCudaBf16Op;
    const int64_t T = 67, h = 300;
    Tensor x = bf16_values_as_f32(random_tensor({T, h}, DType::kF32, 17));
    Tensor w = bf16_values_as_f32(random_tensor({h}, DType::kF32, 18));
    Tensor dy = bf16_values_as_f32(random_tensor({T, h}, DType::kF32, 19));
    Tensor dw0 = bf16_values_as_f32(random_tensor({h}, DType::kF32, 20));
    Tensor y_ref = like(x, DType::kF32), r_ref = Tensor::empty({T}, DType::kF32, MemCategory::kWorkspace);
    ref_->rmsnorm_forward(x, w, 1e-5, y_ref, r_ref);
    Tensor dx_ref = like(x, DType::kF32), dw_ref = dw0.clone(MemCategory::kWorkspace);
    ref_->rmsnorm_backward(x, w, r_ref, dy, dx_ref, dw_ref);

    Tensor xd = x.to(dt, MemCategory::kWorkspace), wd = w.to(dt, MemCategory::kWorkspace);
    Tensor y = like(x, dt), r = Tensor::empty({T}, DType::kF32, MemCategory::kWorkspace);
    cuda_->rmsnorm_forward(xd, wd, 1e-5, y, r);
    EXPECT_TRUE(near_rel(y, y_ref, tol)) << dtype_name(dt);
    EXPECT_TRUE(near_rel(r, r_ref, kCudaF32Op)) << dtype_name(dt);
    Tensor dx = like(x, dt), dw = dw0.to(dt, MemCategory::kWorkspace);
    cuda_->rmsnorm_backward(xd, wd, r_ref, dy.to(dt, MemCategory::kWorkspace), dx, dw);
    EXPECT_TRUE(near_rel(dx, dx_ref, tol)) << dtype_name(dt);
    EXPECT_TRUE(near_rel(dw, dw_ref, tol)) << dtype_name(dt);
  }
}

TEST_F(CudaOps, RopeAtNonContiguousPositions) {
  const int64_t B = 2, S = 9, n = 3, d = 16;
  std::vector<int32_t> pos = {0, 1, 2, 15, 16, 17, 500, 501, 4000};
  Tensor table = build_rope_table(*make_reference_backend(), pos, d, 10000.0, DType::kF32);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const double tol = dt == DType::kF32 ? kCudaF32Op : kCudaBf16Op;
    Tensor x = bf16_values_as_f32(random_tensor({B, S, n, d}, DType::kF32, 21));
    Tensor want = x.clone(MemCategory::kWorkspace), got = x.to(dt, MemCategory::kWorkspace);
    ref_->rope_forward(table, want);
    cuda_->rope_forward(table, got);
    EXPECT_TRUE(near_rel(got, want, tol)) << dtype_name(dt);
    ref_->rope_backward(table, want);
    cuda_->rope_backward(table, got);
    EXPECT_TRUE(near_rel(got, x, 2 * tol)) << "backward undoes forward, " << dtype_name(dt);
  }
}

TEST_F(CudaOps, SwigluForwardBackward) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const double tol = dt == DType::kF32 ? kCudaF32Op : kCudaBf16Op;
    Tensor g = bf16_values_as_f32(random_tensor({13, 111}, DType::kF32, 22, 3.0));
    Tensor u = bf16_values_as_f32(random_tensor({13, 111}, DType::kF32, 23));
    Tensor d_o = bf16_values_as_f32(random_tensor({13, 111}, DType::kF32, 24));
    Tensor o_ref = like(g, DType::kF32), dg_ref = like(g, DType::kF32), du_ref = like(g, DType::kF32);
    ref_->swiglu_forward(g, u, o_ref);
    ref_->swiglu_backward(g, u, d_o, dg_ref, du_ref);
    Tensor gd = g.to(dt, MemCategory::kWorkspace), ud = u.to(dt, MemCategory::kWorkspace);
    Tensor o = like(g, dt), dg = like(g, dt), du = like(g, dt);
    cuda_->swiglu_forward(gd, ud, o);
    cuda_->swiglu_backward(gd, ud, d_o.to(dt, MemCategory::kWorkspace), dg, du);
    EXPECT_TRUE(near_rel(o, o_ref, tol)) << dtype_name(dt);
    EXPECT_TRUE(near_rel(dg, dg_ref, tol)) << dtype_name(dt);
    EXPECT_TRUE(near_rel(du, du_ref, tol)) << dtype_name(dt);
  }
}

TEST_F(CudaOps, CrossEntropyWithIgnoredTargetsAndVocabularyOffset) {
  const int64_t T = 29, V = 1031;
  Tensor logits = random_tensor({T, V}, DType::kF32, 25, 4.0);
  Tensor tg = ids(T, 0, V, 2);
  tg.data<int32_t>()[3] = -100;
  tg.data<int32_t>()[17] = -100;
  Tensor lse_ref = Tensor::empty({T}, DType::kF32, MemCategory::kWorkspace), lse = like(lse_ref, DType::kF32);
  const double loss_ref = ref_->cross_entropy_forward(logits, tg, -100, lse_ref);
  const double loss = cuda_->cross_entropy_forward(logits, tg, -100, lse);
  EXPECT_NEAR(loss, loss_ref, kCudaF32Op * std::abs(loss_ref));
  EXPECT_TRUE(near_rel(lse, lse_ref, kCudaF32Op));
  // The gradient of a vocabulary shard [300, 700), in place as the model does it.
  Tensor shard = Tensor::empty({T, 400}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t t = 0; t < T; ++t)
    std::copy_n(logits.data<float>() + t * V + 300, 400, shard.data<float>() + t * 400);
  Tensor d_ref = like(shard, DType::kF32), d = shard.clone(MemCategory::kWorkspace);
  ref_->cross_entropy_backward(shard, tg, lse_ref, 300, -100, 1.0 / 27, d_ref);
  cuda_->cross_entropy_backward(d, tg, lse_ref, 300, -100, 1.0 / 27, d);
  EXPECT_TRUE(near_rel(d, d_ref, kCudaF32Op));
  // bf16 logits with f32 lse (stat_dtype).
  Tensor lb = bf16_values_as_f32(logits);
  const double loss_b_ref = ref_->cross_entropy_forward(lb, tg, -100, lse_ref);
  const double loss_b = cuda_->cross_entropy_forward(to_bf16(logits), tg, -100, lse);
  EXPECT_NEAR(loss_b, loss_b_ref, kCudaF32Op * std::abs(loss_b_ref));
  EXPECT_TRUE(near_rel(lse, lse_ref, kCudaF32Op));
}

TEST_F(CudaOps, SoftmaxChunkUpdateOverShards) {
  const int64_t T = 21, V = 900;
  Tensor logits = random_tensor({T, V}, DType::kF32, 26, 3.0);
  Tensor tg = ids(T, 0, V, 3);
  tg.data<int32_t>()[5] = -100;
  auto run = [&](Backend& be, Tensor& mx, Tensor& sum, Tensor& tl) {
    be.fill(-INFINITY, mx);
    be.fill(0, sum);
    be.fill(0, tl);
    for (int64_t off : {0, 300, 600}) {
      Tensor shard = Tensor::empty({T, 300}, DType::kF32, MemCategory::kWorkspace);
      for (int64_t t = 0; t < T; ++t)
        std::copy_n(logits.data<float>() + t * V + off, 300, shard.data<float>() + t * 300);
      be.softmax_chunk_update(shard, tg, off, -100, mx, sum, tl);
    }
  };
  auto vec = [&] { return Tensor::empty({T}, DType::kF32, MemCategory::kWorkspace); };
  Tensor m1 = vec(), s1 = vec(), t1 = vec(), m2 = vec(), s2 = vec(), t2 = vec();
  run(*ref_, m1, s1, t1);
  run(*cuda_, m2, s2, t2);
  EXPECT_EQ(max_rel_error(m2, m1), 0.0);  // a max: exact
  EXPECT_TRUE(near_rel(s2, s1, kCudaF32Op));
  EXPECT_EQ(max_rel_error(t2, t1), 0.0);  // a copy: exact
}

TEST_F(CudaOps, DataOpsMatchTheReference) {
  // copy_strided: bytes unchanged in f32, i32 and bf16.
  const StridedCopy c{3, 5, {2, 7}, {1, 9}};
  Tensor sf = random_tensor({40}, DType::kF32, 1), df = random_tensor({40}, DType::kF32, 2);
  Tensor wf = df.clone(MemCategory::kWorkspace);
  ref_->copy_strided(sf, wf, c);
  cuda_->copy_strided(sf, df, c);
  for (int64_t i = 0; i < 40; ++i) EXPECT_EQ(df.data<float>()[i], wf.data<float>()[i]) << i;
  Tensor si = ids(40, 0, 1000, 1), di = ids(40, 0, 1000, 2), wi = di.clone(MemCategory::kWorkspace);
  ref_->copy_strided(si, wi, c);
  cuda_->copy_strided(si, di, c);
  for (int64_t i = 0; i < 40; ++i) EXPECT_EQ(di.data<int32_t>()[i], wi.data<int32_t>()[i]) << i;
  Tensor sb = to_bf16(sf), db = to_bf16(random_tensor({40}, DType::kF32, 3)), wb = db.clone(MemCategory::kWorkspace);
  ref_->copy_strided(sb, wb, c);
  cuda_->copy_strided(sb, db, c);
  for (int64_t i = 0; i < 40; ++i) EXPECT_EQ(db.data<bf16>()[i].bits, wb.data<bf16>()[i].bits) << i;
  // The host boundary.
  const std::vector<int32_t> host = {5, 6, 7, 8};
  Tensor h = Tensor::empty({4}, DType::kI32, MemCategory::kWorkspace);
  cuda_->copy_from_host(std::as_bytes(std::span<const int32_t>(host)), h);
  std::vector<int32_t> back(4);
  cuda_->copy_to_host(h, std::as_writable_bytes(std::span<int32_t>(back)));
  EXPECT_EQ(back, host);
  EXPECT_EQ(cuda_->count_valid_targets(h, 6), 3);
  // The attention merge, with a row on each -inf side.
  const int64_t B = 2, Sq = 5, n_h = 3, d = 8;
  Tensor bo = random_tensor({B, Sq, n_h, d}, DType::kF32, 4), o = random_tensor({B, Sq, n_h, d}, DType::kF32, 5);
  Tensor bl = random_tensor({B, n_h, Sq}, DType::kF32, 6), l = random_tensor({B, n_h, Sq}, DType::kF32, 7);
  bl.data<float>()[0] = -INFINITY;
  l.data<float>()[1] = -INFINITY;
  Tensor wo = o.clone(MemCategory::kWorkspace), wl = l.clone(MemCategory::kWorkspace);
  ref_->attention_merge(bo, bl, wo, wl);
  cuda_->attention_merge(bo, bl, o, l);
  EXPECT_TRUE(near_rel(o, wo, kCudaF32Op));
  EXPECT_TRUE(near_rel(l, wl, kCudaF32Op));
  // The loss pieces.
  const int64_t T = 300;
  Tensor lm = random_tensor({T}, DType::kF32, 8), gm = random_tensor({T}, DType::kF32, 9);
  Tensor rs = random_tensor({T}, DType::kF32, 10), tl = random_tensor({T}, DType::kF32, 11);
  for (int64_t t = 0; t < T; ++t) {
    gm.data<float>()[t] = std::max(gm.data<float>()[t], lm.data<float>()[t]);
    rs.data<float>()[t] = 1.0f + std::abs(rs.data<float>()[t]);
  }
  Tensor tg = ids(T, -100, 50, 12);
  Tensor wrs = rs.clone(MemCategory::kWorkspace);
  ref_->softmax_rescale(lm, gm, wrs);
  cuda_->softmax_rescale(lm, gm, rs);
  EXPECT_TRUE(near_rel(rs, wrs, kCudaF32Op));
  Tensor lse = like(rs, DType::kF32), wlse = like(rs, DType::kF32);
  const LossSums want = ref_->cross_entropy_finish(gm, wrs, tl, tg, -100, wlse);
  const LossSums got = cuda_->cross_entropy_finish(gm, wrs, tl, tg, -100, lse);
  EXPECT_EQ(got.valid_tokens, want.valid_tokens);
  EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-4 * (1 + std::abs(want.loss_sum)));
  EXPECT_TRUE(near_rel(lse, wlse, kCudaF32Op));
  EXPECT_EQ(cuda_->count_valid_targets(tg, -100), want.valid_tokens);
}

}  // namespace
}  // namespace foldpar
