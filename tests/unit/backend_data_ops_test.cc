// The Backend ops through which strategies move tensor data (block copies, the host
// boundary, the attention merge, the vocabulary loss pieces, the valid-target count):
// each against a plain loop written here, on the reference and the fast CPU backend, and
// through the bf16 storage and timing decorators. The fast backend must equal the formula
// the strategies used before these ops existed bit for bit (the parallel parity goldens
// depend on it).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "backend/backend.h"
#include "backend/bf16_storage_backend.h"
#include "backend/timed_backend.h"
#include "core/tolerance.h"
#include "test_util.h"

namespace foldpar {
namespace {

using testing::near_rel;
using testing::random_tensor;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

class DataOps : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> fast_ = make_cpu_backend();
  std::unique_ptr<Backend> ref_ = make_reference_backend();
  std::vector<Backend*> both() { return {fast_.get(), ref_.get()}; }
};

Tensor i32_values(int64_t n, uint64_t seed) {
  Tensor t = Tensor::empty({n}, DType::kI32, MemCategory::kWorkspace);
  for (int64_t i = 0; i < n; ++i) t.data<int32_t>()[i] = static_cast<int32_t>((i * 7919 + seed * 104729) % 100003);
  return t;
}

// dst after the copy, by the op's definition, element by element.
template <typename T>
std::vector<T> expected_copy(const Tensor& src, const Tensor& dst, const StridedCopy& c) {
  std::vector<T> want(dst.data<T>(), dst.data<T>() + dst.numel());
  for (int64_t i = 0; i < c.rows; ++i)
    for (int64_t j = 0; j < c.cols; ++j)
      want[static_cast<size_t>(c.dst.offset + i * c.dst.row_stride + j)] =
          src.data<T>()[c.src.offset + i * c.src.row_stride + j];
  return want;
}

TEST_F(DataOps, CopyStridedMovesExactlyTheBlockInEveryDtype) {
  // Row gathers, column blocks, interleaving (cols 1, stride 2) and a single row.
  const std::vector<StridedCopy> cases = {
      {3, 5, {2, 7}, {1, 9}}, {4, 1, {0, 1}, {1, 2}}, {1, 11, {4, 0}, {30, 0}}, {5, 6, {0, 6}, {3, 6}},
      {0, 4, {0, 4}, {0, 4}}, {2, 0, {0, 4}, {0, 4}}};
  for (Backend* be : both())
    for (const StridedCopy& c : cases) {
      Tensor s32 = i32_values(48, 1), d32 = i32_values(48, 2);
      const std::vector<int32_t> want32 = expected_copy<int32_t>(s32, d32, c);
      be->copy_strided(s32, d32, c);
      EXPECT_EQ(std::vector<int32_t>(d32.data<int32_t>(), d32.data<int32_t>() + 48), want32) << be->name();

      Tensor sf = random_tensor({48}, DType::kF32, 3), df = random_tensor({48}, DType::kF32, 4);
      const std::vector<float> wantf = expected_copy<float>(sf, df, c);
      be->copy_strided(sf, df, c);
      EXPECT_EQ(std::vector<float>(df.data<float>(), df.data<float>() + 48), wantf) << be->name();

      Tensor sd = random_tensor({48}, DType::kF64, 5), dd = random_tensor({48}, DType::kF64, 6);
      const std::vector<double> wantd = expected_copy<double>(sd, dd, c);
      be->copy_strided(sd, dd, c);
      EXPECT_EQ(std::vector<double>(dd.data<double>(), dd.data<double>() + 48), wantd) << be->name();

      Tensor sb = sf.to(DType::kBF16, MemCategory::kWorkspace), db = df.to(DType::kBF16, MemCategory::kWorkspace);
      std::vector<uint16_t> wantb(48);
      for (int64_t i = 0; i < 48; ++i) wantb[static_cast<size_t>(i)] = db.data<bf16>()[i].bits;
      for (int64_t i = 0; i < c.rows; ++i)
        for (int64_t j = 0; j < c.cols; ++j)
          wantb[static_cast<size_t>(c.dst.offset + i * c.dst.row_stride + j)] =
              sb.data<bf16>()[c.src.offset + i * c.src.row_stride + j].bits;
      be->copy_strided(sb, db, c);
      for (int64_t i = 0; i < 48; ++i) EXPECT_EQ(db.data<bf16>()[i].bits, wantb[static_cast<size_t>(i)]) << i;
    }
}

TEST_F(DataOps, CopyStridedRefusesBlocksOutsideTheTensors) {
  Tensor a = i32_values(10, 1), b = i32_values(10, 2);
  Tensor f = random_tensor({10}, DType::kF32, 1);
  for (Backend* be : both()) {
    EXPECT_DEATH(be->copy_strided(a, b, {2, 5, {0, 6}, {0, 5}}), "reach element 11");
    EXPECT_DEATH(be->copy_strided(a, b, {2, 5, {0, 5}, {1, 5}}), "destination");
    EXPECT_DEATH(be->copy_strided(a, b, {2, 5, {0, 5}, {0, 3}}), "overlap");
    EXPECT_DEATH(be->copy_strided(a, f, {1, 1, {0, 1}, {0, 1}}), "dtypes differ");
    EXPECT_DEATH(be->copy_strided(a, b, {1, 1, {-1, 1}, {0, 1}}), "offset -1");
  }
}

TEST_F(DataOps, HostCopiesRoundTripAndCheckTheSize) {
  for (Backend* be : both()) {
    const std::vector<int32_t> host = {3, -1, 7, 100000, 0, 42};
    Tensor t = Tensor::empty({2, 3}, DType::kI32, MemCategory::kWorkspace);
    be->copy_from_host(std::as_bytes(std::span<const int32_t>(host)), t);
    for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(t.data<int32_t>()[i], host[static_cast<size_t>(i)]);
    std::vector<int32_t> back(6, -7);
    be->copy_to_host(t, std::as_writable_bytes(std::span<int32_t>(back)));
    EXPECT_EQ(back, host);
    std::vector<int32_t> short_host(5);
    EXPECT_DEATH(be->copy_from_host(std::as_bytes(std::span<const int32_t>(short_host)), t), "20 host bytes");
    EXPECT_DEATH(be->copy_to_host(t, std::as_writable_bytes(std::span<int32_t>(short_host))), "20 host bytes");
  }
}

// Every explicit host copy is counted once by the tensor's tracker (MemoryStats::host_bytes_in
// / host_bytes_out), through a backend, a decorator over one, or Tensor's own copies; device
// ops are not.
TEST_F(DataOps, HostCopiesAreCountedOnceByTheTensorsTracker) {
  std::unique_ptr<Backend> bf16 = make_bf16_storage_backend(*fast_);
  TimedBackend timed(*fast_);
  for (Backend* be : {fast_.get(), ref_.get(), bf16.get(), static_cast<Backend*>(&timed)}) {
    MemoryTracker tracker;
    Tensor t = Tensor::empty({2, 3}, DType::kI32, MemCategory::kWorkspace, tracker);
    Tensor u = Tensor::empty({2, 3}, DType::kI32, MemCategory::kWorkspace, tracker);
    const std::vector<int32_t> host = {1, 2, 3, 4, 5, 6};
    std::vector<int32_t> back(6);
    be->copy_from_host(std::as_bytes(std::span<const int32_t>(host)), t);  // 24 in
    be->copy(t, u);                                                          // device side: not counted
    be->copy_to_host(u, std::as_writable_bytes(std::span<int32_t>(back)));   // 24 out
    be->copy_to_host(u.narrow(0, 1), std::as_writable_bytes(std::span<int32_t>(back).first(3)));  // 12 out (a view)
    u.copy_from_host(std::as_bytes(std::span<const int32_t>(host)));        // 24 in (Tensor's own)
    EXPECT_EQ(tracker.stats().host_bytes_in, 48);
    EXPECT_EQ(tracker.stats().host_bytes_out, 36);
    EXPECT_EQ(back, host);
  }
}

// The merge by its definition in f64, as backend.h states it.
void expected_merge(const Tensor& bo, const Tensor& bl, std::vector<double>& o, std::vector<double>& l, int64_t B,
                    int64_t Sq, int64_t n_h, int64_t d) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < n_h; ++h)
      for (int64_t i = 0; i < Sq; ++i) {
        const size_t li = static_cast<size_t>((b * n_h + h) * Sq + i), oi = static_cast<size_t>(((b * Sq + i) * n_h + h) * d);
        const double a = l[li], c = bl.data<float>()[li];
        if (std::isinf(c)) continue;
        const double m = std::isinf(a) ? c : std::max(a, c);
        const double ea = std::isinf(a) ? 0.0 : std::exp(a - m), ec = std::exp(c - m);
        for (size_t e = 0; e < static_cast<size_t>(d); ++e)
          o[oi + e] = (ea * o[oi + e] + ec * bo.data<float>()[oi + e]) / (ea + ec);
        l[li] = m + std::log(ea + ec);
      }
}

TEST_F(DataOps, AttentionMergeMatchesTheDefinitionWithInfiniteRows) {
  const int64_t B = 2, Sq = 5, n_h = 3, d = 7;
  Tensor bo = random_tensor({B, Sq, n_h, d}, DType::kF32, 1), out0 = random_tensor({B, Sq, n_h, d}, DType::kF32, 2);
  Tensor bl = random_tensor({B, n_h, Sq}, DType::kF32, 3, 2.0), lse0 = random_tensor({B, n_h, Sq}, DType::kF32, 4, 2.0);
  // Every combination of a side that saw nothing.
  bl.data<float>()[0] = kNegInf;
  lse0.data<float>()[1] = kNegInf;
  bl.data<float>()[2] = kNegInf;
  lse0.data<float>()[2] = kNegInf;
  std::vector<double> wo(out0.data<float>(), out0.data<float>() + out0.numel());
  std::vector<double> wl(lse0.data<float>(), lse0.data<float>() + lse0.numel());
  expected_merge(bo, bl, wo, wl, B, Sq, n_h, d);
  Tensor fo, fl;
  for (Backend* be : both()) {
    Tensor o = out0.clone(MemCategory::kWorkspace), l = lse0.clone(MemCategory::kWorkspace);
    be->attention_merge(bo, bl, o, l);
    for (int64_t i = 0; i < o.numel(); ++i)
      EXPECT_NEAR(o.data<float>()[i], wo[static_cast<size_t>(i)], 1e-5 * (1 + std::abs(wo[static_cast<size_t>(i)])))
          << be->name() << " out " << i;
    for (int64_t i = 0; i < l.numel(); ++i) {
      const double w = wl[static_cast<size_t>(i)];
      if (std::isinf(w)) {
        EXPECT_EQ(l.data<float>()[i], kNegInf) << be->name() << " lse " << i;
      } else {
        EXPECT_NEAR(l.data<float>()[i], w, 1e-5 * (1 + std::abs(w))) << be->name() << " lse " << i;
      }
    }
    if (be == fast_.get()) {
      fo = o;
      fl = l;
    } else {  // the reference rounds the same f64 weights: the fast backend agrees with it to f32 rounding
      EXPECT_TRUE(near_rel(fo, o, tol::kF32Op));
      EXPECT_TRUE(near_rel(fl, l, tol::kF32Op));
    }
  }
  // Both sides -inf: out and lse unchanged (0 and -inf when nothing was ever seen).
  EXPECT_EQ(fl.data<float>()[2], kNegInf);
  for (int64_t e = 0; e < d; ++e) EXPECT_EQ(fo.data<float>()[2 * n_h * d + e], out0.data<float>()[2 * n_h * d + e]);
}

TEST_F(DataOps, AttentionMergeRefusesMismatchedShapes) {
  Tensor o = random_tensor({1, 2, 3, 4}, DType::kF32, 1), l = random_tensor({1, 3, 2}, DType::kF32, 2);
  Tensor bo = random_tensor({1, 2, 3, 5}, DType::kF32, 3);
  for (Backend* be : both()) EXPECT_DEATH(be->attention_merge(bo, l, o, l), "attention_merge of block");
}

TEST_F(DataOps, SoftmaxRescaleAndFinishGiveTheLossOfTheFullVocabulary) {
  // Two vocabulary shards of logits [T, 2 * Vc]; the shard statistics rescaled to the global
  // maximum and summed must give cross_entropy_forward's loss on the full logits.
  const int64_t T = 9, Vc = 13, V = 2 * Vc;
  Tensor logits = random_tensor({T, V}, DType::kF32, 7, 3.0);
  Tensor targets = Tensor::empty({T}, DType::kI32, MemCategory::kWorkspace);
  for (int64_t t = 0; t < T; ++t) targets.data<int32_t>()[t] = t % 4 == 3 ? -100 : static_cast<int32_t>((t * 5) % V);
  for (Backend* be : both()) {
    Tensor full_lse = Tensor::empty({T}, DType::kF32, MemCategory::kWorkspace);
    const double want = ref_->cross_entropy_forward(logits, targets, -100, full_lse);
    std::vector<Tensor> lmax, sums;  // per shard: local max [T]; [row_sum | target_logit] [2, T]
    for (int64_t s = 0; s < 2; ++s) {
      Tensor chunk = Tensor::empty({T, Vc}, DType::kF32, MemCategory::kWorkspace);
      be->copy_strided(logits, chunk, {T, Vc, {s * Vc, V}, {0, Vc}});
      Tensor m = Tensor::empty({T}, DType::kF32, MemCategory::kWorkspace);
      Tensor st = Tensor::empty({2, T}, DType::kF32, MemCategory::kWorkspace);
      be->fill(kNegInf, m);
      be->fill(0.0, st);
      Tensor rs = st.narrow(0, 1).reshape({T}), tl = st.narrow(1, 2).reshape({T});
      be->softmax_chunk_update(chunk, targets, s * Vc, -100, m, rs, tl);
      lmax.push_back(m);
      sums.push_back(st);
    }
    Tensor gmax = Tensor::empty({T}, DType::kF32, MemCategory::kWorkspace);
    for (int64_t t = 0; t < T; ++t) gmax.data<float>()[t] = std::max(lmax[0].data<float>()[t], lmax[1].data<float>()[t]);
    for (int64_t s = 0; s < 2; ++s) {
      Tensor rs = sums[s].narrow(0, 1).reshape({T});
      be->softmax_rescale(lmax[s], gmax, rs);
    }
    be->add_inplace(sums[1], sums[0]);  // the all_reduce of the strategies
    Tensor rs = sums[0].narrow(0, 1).reshape({T}), tl = sums[0].narrow(1, 2).reshape({T});
    Tensor lse = Tensor::empty({T}, DType::kF32, MemCategory::kWorkspace);
    const LossSums got = be->cross_entropy_finish(gmax, rs, tl, targets, -100, lse);
    EXPECT_EQ(got.valid_tokens, 7) << be->name();
    EXPECT_NEAR(got.loss_sum, want, 1e-5 * std::abs(want)) << be->name();
    for (int64_t t = 0; t < T; ++t) {
      const double want_lse = static_cast<double>(gmax.data<float>()[t]) + std::log(static_cast<double>(rs.data<float>()[t]));
      EXPECT_NEAR(lse.data<float>()[t], want_lse, 1e-5) << be->name() << " row " << t;
      if (targets.data<int32_t>()[t] != -100) {
        EXPECT_NEAR(lse.data<float>()[t], full_lse.data<float>()[t], 1e-5) << be->name() << " row " << t;
      }
    }
  }
}

TEST_F(DataOps, FastLossPiecesEqualTheF32FormulaBitForBit) {
  // The formulas the strategies computed on the host before these ops: f32 exp and log,
  // the loss summed in f64 in row order.
  const int64_t T = 37;
  Tensor lm = random_tensor({T}, DType::kF32, 1), gm = random_tensor({T}, DType::kF32, 2);
  for (int64_t t = 0; t < T; ++t) gm.data<float>()[t] = std::max(gm.data<float>()[t], lm.data<float>()[t]);
  Tensor rs = random_tensor({T}, DType::kF32, 3), tl = random_tensor({T}, DType::kF32, 4);
  for (int64_t t = 0; t < T; ++t) rs.data<float>()[t] = 1.0f + std::abs(rs.data<float>()[t]) * 40.0f;
  Tensor targets = Tensor::empty({T}, DType::kI32, MemCategory::kWorkspace);
  for (int64_t t = 0; t < T; ++t) targets.data<int32_t>()[t] = t % 5 == 0 ? -100 : static_cast<int32_t>(t);
  std::vector<float> want_rs(static_cast<size_t>(T)), want_lse(static_cast<size_t>(T));
  double want_loss = 0;
  for (int64_t t = 0; t < T; ++t) {
    const size_t i = static_cast<size_t>(t);
    want_rs[i] = rs.data<float>()[t] * std::exp(lm.data<float>()[t] - gm.data<float>()[t]);
    want_lse[i] = gm.data<float>()[t] + std::log(want_rs[i]);
    if (targets.data<int32_t>()[t] != -100)
      want_loss += static_cast<double>(want_lse[i]) - static_cast<double>(tl.data<float>()[t]);
  }
  fast_->softmax_rescale(lm, gm, rs);
  Tensor lse = Tensor::empty({T}, DType::kF32, MemCategory::kWorkspace);
  const LossSums got = fast_->cross_entropy_finish(gm, rs, tl, targets, -100, lse);
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(rs.data<float>()[t], want_rs[static_cast<size_t>(t)]) << t;
    EXPECT_EQ(lse.data<float>()[t], want_lse[static_cast<size_t>(t)]) << t;
  }
  EXPECT_EQ(got.loss_sum, want_loss);
  EXPECT_EQ(got.valid_tokens, 29);
}

TEST_F(DataOps, CountValidTargetsOfAnyShape) {
  Tensor t = Tensor::empty({3, 4}, DType::kI32, MemCategory::kWorkspace);
  for (int64_t i = 0; i < 12; ++i) t.data<int32_t>()[i] = i % 3 == 1 ? -100 : static_cast<int32_t>(i);
  for (Backend* be : both()) {
    EXPECT_EQ(be->count_valid_targets(t, -100), 8) << be->name();
    EXPECT_EQ(be->count_valid_targets(t, 0), 11) << be->name();
    Tensor f = random_tensor({3}, DType::kF32, 1);
    EXPECT_DEATH(be->count_valid_targets(f, -100), "not i32");
  }
}

// copy between f32 and bf16: widening is exact, narrowing is f32_to_bf16 (nearest even, NaN
// kept) element by element, on both backends; the decorator's widen and round are this op.
TEST_F(DataOps, CopyConvertsBetweenF32AndBf16) {
  Tensor f = random_tensor({5, 7}, DType::kF32, 11);
  f.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();
  f.data<float>()[1] = kNegInf;
  f.data<float>()[2] = 1.0f + 1.0f / 256;  // a tie: rounds to even (1.0)
  f.data<float>()[3] = 1.0f + 3.0f / 256;  // a tie: rounds to even (1 + 4/256)
  for (Backend* be : both()) {
    SCOPED_TRACE(be->name());
    Tensor b = Tensor::empty({35}, DType::kBF16, MemCategory::kWorkspace);
    be->copy(f, b);
    for (int64_t i = 0; i < f.numel(); ++i) EXPECT_EQ(b.data<bf16>()[i].bits, f32_to_bf16(f.data<float>()[i]).bits) << i;
    EXPECT_EQ(b.data<bf16>()[2].bits, f32_to_bf16(1.0f).bits);
    Tensor back = Tensor::empty({5, 7}, DType::kF32, MemCategory::kWorkspace);
    be->copy(b, back);
    for (int64_t i = 0; i < f.numel(); ++i) {
      const float want = bf16_to_f32(b.data<bf16>()[i]);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(back.data<float>()[i])) << i;
      } else {
        EXPECT_EQ(back.data<float>()[i], want) << i;
      }
    }
  }
}

TEST_F(DataOps, DecoratorsForwardTheDataOps) {
  TimedBackend timed(*fast_);
  std::unique_ptr<Backend> bf = make_bf16_storage_backend(timed);
  // bf16 storage: the merge widens, merges in f32 and rounds once.
  const int64_t B = 1, Sq = 3, n_h = 2, d = 4;
  Tensor bo = random_tensor({B, Sq, n_h, d}, DType::kF32, 1), o = random_tensor({B, Sq, n_h, d}, DType::kF32, 2);
  Tensor bl = random_tensor({B, n_h, Sq}, DType::kF32, 3), l = random_tensor({B, n_h, Sq}, DType::kF32, 4);
  Tensor bo16 = bo.to(DType::kBF16, MemCategory::kWorkspace), o16 = o.to(DType::kBF16, MemCategory::kWorkspace);
  Tensor wo = o16.to(DType::kF32, MemCategory::kWorkspace), wl = l.clone(MemCategory::kWorkspace);
  fast_->attention_merge(bo16.to(DType::kF32, MemCategory::kWorkspace), bl, wo, wl);
  bf->attention_merge(bo16, bl, o16, l);
  const Tensor want16 = wo.to(DType::kBF16, MemCategory::kWorkspace);
  for (int64_t i = 0; i < o16.numel(); ++i) EXPECT_EQ(o16.data<bf16>()[i].bits, want16.data<bf16>()[i].bits) << i;
  for (int64_t i = 0; i < l.numel(); ++i) EXPECT_EQ(l.data<float>()[i], wl.data<float>()[i]) << i;
  // Bytes move unchanged through both decorators.
  Tensor s = i32_values(8, 1), dst = i32_values(8, 2);
  bf->copy_strided(s, dst, {2, 2, {0, 4}, {1, 4}});
  EXPECT_EQ(dst.data<int32_t>()[1], s.data<int32_t>()[0]);
  EXPECT_EQ(dst.data<int32_t>()[6], s.data<int32_t>()[5]);
  const std::vector<int32_t> host = {1, 2, 3, 4, 5, 6, 7, 8};
  bf->copy_from_host(std::as_bytes(std::span<const int32_t>(host)), dst);
  std::vector<int32_t> back(8);
  bf->copy_to_host(dst, std::as_writable_bytes(std::span<int32_t>(back)));
  EXPECT_EQ(back, host);
  EXPECT_EQ(bf->count_valid_targets(dst, 3), 7);
  for (const char* op : {"attention_merge", "copy_strided", "copy_from_host", "copy_to_host", "count_valid_targets"})
    EXPECT_EQ(timed.times().at(op).calls, 1) << op;
}

}  // namespace
}  // namespace foldpar
