// Parity of the blocked flash attention kernel (the fast CPU backend) with the reference
// backend (plain loops, fp64 accumulation): forward out and lse, backward dq, dk and dv, on
// shapes that are not multiples of any block, GQA groups, zigzag and unsorted positions and
// queries that see no key; plus the bound on the kernel's workspace. The bf16 kernel (bf16
// operands, f32 accumulation) on the same cases against the reference on bf16-rounded
// inputs, and the bf16 storage decorator's widening path against the f32 kernel. Sliding
// windows (issue 21) on the same parity harness, and a check that whole tiles behind the
// window are skipped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/bf16_storage_backend.h"
#include "backend/cpu/gemm_engine.h"
#include "backend/timed_backend.h"
#include "core/rng.h"
#include "core/tolerance.h"
#include "tensor/memory_tracker.h"
#include "tensor/tensor.h"

namespace foldpar {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

struct AttnCase {
  std::string name;
  int64_t batch, n_h, n_kv, d;
  std::vector<int32_t> q_pos, k_pos;  // Sq and Sk are their lengths
  double scale = 0;                   // 0: 1 / sqrt(d)
  int64_t window = 0;                 // sliding window; 0: full causal
  double cancel_min_scale = 0;        // 0: kCancelMinScale (below)
};

std::vector<int32_t> iota_pos(int64_t n, int32_t first) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), first);
  return p;
}

// Rank `rank` of `degree` in the zigzag layout of S tokens: chunks rank and 2*degree-1-rank
// of 2*degree equal chunks.
std::vector<int32_t> zigzag_pos(int64_t S, int rank, int degree) {
  const int64_t chunk = S / (2 * degree);
  std::vector<int32_t> p = iota_pos(chunk, static_cast<int32_t>(rank * chunk));
  const std::vector<int32_t> hi = iota_pos(chunk, static_cast<int32_t>((2 * degree - 1 - rank) * chunk));
  p.insert(p.end(), hi.begin(), hi.end());
  return p;
}

// n distinct positions 3 * perm + offset, in a random order (gaps and no sorting).
std::vector<int32_t> shuffled_pos(int64_t n, int32_t offset, uint64_t seed) {
  std::vector<int32_t> p = iota_pos(n, 0);
  Rng rng(seed);
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[rng.below(static_cast<uint64_t>(i + 1))]);
  for (int32_t& x : p) x = 3 * x + offset;
  return p;
}

Tensor random_tensor(const Shape& shape, const char* stream) {
  Tensor t = Tensor::empty(shape, DType::kF32, MemCategory::kActivations);
  float* x = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) x[i] = static_cast<float>(normal_at(7, stream_id(stream), i));
  return t;
}

Tensor i32_tensor(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::kI32, MemCategory::kActivations);
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t;
}

Tensor nan_like(const Tensor& t) {  // outputs start as NaN: the kernels must write every element
  Tensor o = Tensor::empty(t.shape(), DType::kF32, MemCategory::kActivations);
  std::fill_n(o.data<float>(), o.numel(), static_cast<float>(kNan));
  return o;
}

// Normwise relative error max|a - ref| / max(|ref|, min_scale) over the entries where ref is
// finite; a must be -inf exactly where ref is (the lse of a query that sees no key). On
// failure, names the tensor and the first mismatches with index, both values and tolerance.
testing::AssertionResult close_to(const Tensor& a, const Tensor& ref, double tol, double min_scale,
                                  const std::string& what) {
  const float *x = a.data<float>(), *y = ref.data<float>();
  double scale = min_scale;
  for (int64_t i = 0; i < ref.numel(); ++i)
    if (std::isfinite(y[i])) scale = std::max(scale, std::abs(static_cast<double>(y[i])));
  auto error_at = [&](int64_t i) -> double {
    if (!std::isfinite(y[i])) return x[i] == y[i] ? 0.0 : std::numeric_limits<double>::infinity();
    const double diff = std::abs(static_cast<double>(x[i]) - y[i]);
    return std::isnan(diff) ? std::numeric_limits<double>::infinity() : diff / scale;
  };
  double worst = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) worst = std::max(worst, error_at(i));
  if (worst <= tol) return testing::AssertionSuccess() << what << " error " << worst;
  auto failure = testing::AssertionFailure();
  failure << what << ": max|diff| / max|ref| = " << worst << " > tol " << tol << " (max|ref| " << scale << ")\n";
  int shown = 0;
  for (int64_t i = 0; i < ref.numel() && shown < 5; ++i)
    if (error_at(i) > tol) {
      failure << "  [" << i << "] got " << x[i] << ", want " << y[i] << "\n";
      ++shown;
    }
  return failure;
}

// Where the tolerance comes from: the fast kernel rounds to f32 (6e-8) along accumulation
// chains of length d (scores, dP), Sk (softmax sum, P V, dQ) and Sq * g (dK, dV), at most
// ~1300 here; sgemm's blocked sums grow like sqrt(length) * 6e-8, vec::exp adds < 2 ulp per
// probability, and an absolute score error e becomes a relative error e in its probability.
// Observed: up to 1.3e-6 at scale 1/sqrt(d), 4e-6 with unscaled scores (|s| ~ 8). The bound
// is tol::kF32Op (2e-5, core/tolerance.h), the project's bound for one f32 op against the
// reference; a wrong mask, scale, head mapping or block boundary shows errors of 1e-2 to 1.
constexpr double kTol = tol::kF32Op;
// lse is a log: its error is absolute (about |lse| * eps), so it is measured against
// max(max|lse|, 1) rather than letting a tensor of small lse values shrink the scale.
constexpr double kLseMinScale = 1.0;
// dQ and dK are sums of P (dP - delta) terms. With one visible key they cancel to exactly 0,
// and what is left is rounding of dot products of N(0, 1) rows: observed up to 9.5e-8 with
// oneDNN's sgemm. So their scale is at least 0.05 (an absolute bound of 1e-6); the smallest
// nonzero max|dQ| or max|dK| among the cases is 0.094, so no other case is loosened.
constexpr double kCancelMinScale = 0.05;

class FlashAttentionParity : public testing::TestWithParam<AttnCase> {};

TEST_P(FlashAttentionParity, ForwardAndBackwardMatchReference) {
  const AttnCase& c = GetParam();
  const int64_t sq = static_cast<int64_t>(c.q_pos.size()), sk = static_cast<int64_t>(c.k_pos.size());
  const Tensor q = random_tensor({c.batch, sq, c.n_h, c.d}, "q");
  const Tensor k = random_tensor({c.batch, sk, c.n_kv, c.d}, "k");
  const Tensor v = random_tensor({c.batch, sk, c.n_kv, c.d}, "v");
  const Tensor d_out = random_tensor({c.batch, sq, c.n_h, c.d}, "d_out");
  const Tensor q_pos = i32_tensor(c.q_pos), k_pos = i32_tensor(c.k_pos);
  AttentionArgs args{&q, &k, &v, &q_pos, &k_pos, c.scale != 0 ? c.scale : 1.0 / std::sqrt(double(c.d)), c.window};
  auto ref = make_reference_backend();
  auto fast = make_cpu_backend();

  const Tensor lse_shape = Tensor::empty({c.batch, c.n_h, sq}, DType::kF32, MemCategory::kActivations);
  Tensor ref_out = nan_like(q), ref_lse = nan_like(lse_shape);
  Tensor out = nan_like(q), lse = nan_like(lse_shape);
  ref->attention_forward(args, ref_out, ref_lse);
  fast->attention_forward(args, out, lse);
  EXPECT_TRUE(close_to(out, ref_out, kTol, 0.0, "out"));
  EXPECT_TRUE(close_to(lse, ref_lse, kTol, kLseMinScale, "lse"));

  // Both backwards start from the reference forward, so only the backward kernel is compared.
  Tensor ref_dq = nan_like(q), ref_dk = nan_like(k), ref_dv = nan_like(v);
  Tensor dq = nan_like(q), dk = nan_like(k), dv = nan_like(v);
  ref->attention_backward(args, ref_out, ref_lse, d_out, ref_dq, ref_dk, ref_dv);
  fast->attention_backward(args, ref_out, ref_lse, d_out, dq, dk, dv);
  const double cancel = c.cancel_min_scale != 0 ? c.cancel_min_scale : kCancelMinScale;
  EXPECT_TRUE(close_to(dq, ref_dq, kTol, cancel, "dq"));
  EXPECT_TRUE(close_to(dk, ref_dk, kTol, cancel, "dk"));
  EXPECT_TRUE(close_to(dv, ref_dv, kTol, 0.0, "dv"));
}

std::vector<AttnCase> parity_cases() {
  std::vector<AttnCase> cases;
  auto causal = [&](std::string name, int64_t batch, int64_t S, int64_t n_h, int64_t n_kv, int64_t d) {
    cases.push_back({std::move(name), batch, n_h, n_kv, d, iota_pos(S, 0), iota_pos(S, 0)});
  };
  causal("single_token", 1, 1, 2, 2, 16);
  causal("s7_d8_three_heads", 1, 7, 3, 3, 8);
  causal("s129_gqa2_d64", 1, 129, 4, 2, 64);
  causal("s300_mha_d128", 1, 300, 2, 2, 128);
  causal("s300_gqa4_d128_b2", 2, 300, 4, 1, 128);
  causal("s1000_mha_d16_b2", 2, 1000, 2, 2, 16);
  causal("s70_gqa8_d16", 1, 70, 8, 1, 16);
  // A TSP rank's zigzag chunks of a 512-token sequence against all keys.
  cases.push_back({"zigzag_rank0_of_4", 1, 4, 2, 64, zigzag_pos(512, 0, 4), iota_pos(512, 0)});
  cases.push_back({"zigzag_rank1_of_4_d128", 1, 2, 2, 128, zigzag_pos(512, 1, 4), iota_pos(512, 0)});
  cases.push_back({"zigzag_rank1_of_2_gqa2", 2, 4, 2, 32, zigzag_pos(600, 1, 2), iota_pos(600, 0)});
  // Unsorted, gapped positions; the queries below offset 40 see no key.
  cases.push_back({"unsorted_gapped", 1, 4, 2, 32, shuffled_pos(150, 0, 1), shuffled_pos(260, 40, 2)});
  // Keys start at 300: the first 300 queries (more than a whole q block) see nothing.
  cases.push_back({"queries_without_keys", 1, 2, 1, 64, iota_pos(600, 0), iota_pos(300, 300)});
  // One decoding query against a long cache.
  cases.push_back({"one_query_1000_keys_gqa4", 1, 4, 1, 128, {999}, iota_pos(1000, 0)});
  // More queries than keys.
  cases.push_back({"sq300_sk100", 1, 2, 2, 64, iota_pos(300, 0), iota_pos(100, 0)});
  // Keys in reverse order and unscaled scores (|s| ~ 8): each later k block raises the
  // running max, exercising the online rescaling.
  std::vector<int32_t> reversed = iota_pos(600, 0);
  std::reverse(reversed.begin(), reversed.end());
  cases.push_back({"reversed_keys_large_scores", 1, 2, 2, 64, iota_pos(600, 0), reversed, 1.0});
  cases.push_back({"no_keys", 1, 2, 1, 16, iota_pos(5, 0), {}});
  // Sliding windows (issue 21): smaller than a 256-key tile, odd, exactly a tile, one key
  // (each query sees itself only), just under, equal to and above the sequence length.
  auto windowed = [&](std::string name, int64_t S, int64_t n_h, int64_t n_kv, int64_t d, int64_t window) {
    cases.push_back({std::move(name), 1, n_h, n_kv, d, iota_pos(S, 0), iota_pos(S, 0), 0, window});
  };
  // Window 1: P = 1 and dQ = dK = 0 exactly for every query (not only the first, as in the
  // causal cases), so what is compared is the rounding of dP - delta (two f32 dot products
  // of length d) over 300 rows: observed 1.9e-6 absolute at d = 32. Floor 0.25 (an absolute
  // 5e-6); a query that saw a second key would have |dQ| near 0.1.
  windowed("window1_s300", 300, 2, 2, 32, 1);
  cases.back().cancel_min_scale = 0.25;
  windowed("window7_s300_gqa2", 300, 4, 2, 32, 7);
  windowed("window100_s521_gqa4", 521, 4, 1, 32, 100);
  windowed("window256_s530", 530, 2, 2, 16, 256);
  windowed("window299_s300", 300, 2, 2, 16, 299);
  windowed("window300_s300", 300, 2, 2, 16, 300);
  windowed("window1000_s300", 300, 2, 2, 16, 1000);
  cases.push_back({"window50_zigzag_rank1_of_2", 1, 4, 2, 32, zigzag_pos(600, 1, 2), iota_pos(600, 0), 0, 50});
  cases.push_back({"window33_unsorted_gapped", 1, 4, 2, 32, shuffled_pos(150, 0, 1), shuffled_pos(260, 40, 2), 0, 33});
  cases.push_back({"window64_one_query_1000_keys", 1, 4, 1, 128, {999}, iota_pos(1000, 0), 0, 64});
  cases.push_back({"window90_reversed_keys", 1, 2, 2, 64, iota_pos(600, 0), reversed, 1.0, 90});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, FlashAttentionParity, testing::ValuesIn(parity_cases()),
                         [](const testing::TestParamInfo<AttnCase>& p) { return p.param.name; });

// ---- the bf16 kernel ----

Tensor to_bf16(const Tensor& t) {  // rounded to nearest even
  Tensor o = Tensor::empty(t.shape(), DType::kBF16, MemCategory::kActivations);
  for (int64_t i = 0; i < t.numel(); ++i) o.data<bf16>()[i] = f32_to_bf16(t.data<float>()[i]);
  return o;
}
Tensor to_f32(const Tensor& t) {
  Tensor o = Tensor::empty(t.shape(), DType::kF32, MemCategory::kActivations);
  for (int64_t i = 0; i < t.numel(); ++i) o.data<float>()[i] = bf16_to_f32(t.data<bf16>()[i]);
  return o;
}
Tensor nan_bf16_like(const Tensor& t) { return to_bf16(nan_like(t)); }

// Where the bf16 tolerances come from (u = 2^-8, the relative rounding error of bf16, whose
// significand has 8 bits; both sides see the same bf16-rounded q, k, v, dO, and the reference
// accumulates in fp64). Products of two bf16 numbers are exact in f32 and the sums are f32, so
// S and dP carry only f32 error (tol::kF32Op above). What bf16 adds:
//  - out: P rounded to bf16 perturbs each term of sum_j P_j V_j / l by at most u relative,
//    at most u * max|V| in all, but the roundings are independent, so the sum moves like
//    u * max|V| * sqrt(sum_j P_j^2) / l, far less once a row spreads over many keys; and out
//    itself is rounded once, u * |out|. With max|V| about 4 for N(0, 1) values and max|out|
//    at least about 1 (the first query sees one key: out = V_0), the normwise bound is
//    u * (1 + 4) ~ 2e-2 worst case; observed up to 3.3e-3 (out), 4.0e-3 (dV): the final rounding
//    dominates. kBf16Out = 2u = 7.8e-3.
//  - dV = sum_rows P^T dO: the same argument, P and dV rounded: kBf16Out.
//  - dQ, dK = sum scale * dS K (dS^T Q): dS = P (dP - delta) is rounded to bf16 (u relative
//    per term) and the terms of each row cancel (they sum to zero), so the error is relative
//    to sum |dS| |K|, not to |dQ|: several u worst case; observed up to 4.8e-3. kBf16Grad = 4u = 1.6e-2, measured against
//    max(max|ref|, kCancelMinScale) as above. A wrong mask, scale, head mapping or block
//    boundary shows errors of 1e-1 to 1, above both.
//  - lse is computed from f32 scores and stays f32: kTol.
constexpr double kBf16U = 1.0 / 256;
constexpr double kBf16Out = 2 * kBf16U;
constexpr double kBf16Grad = 4 * kBf16U;

bool bf16_native() { return gemm_engine_report().bf16_native; }

class FlashAttentionBf16Parity : public testing::TestWithParam<AttnCase> {};

TEST_P(FlashAttentionBf16Parity, ForwardAndBackwardMatchReferenceOnRoundedInputs) {
  if (!bf16_native()) GTEST_SKIP() << "no bf16 instructions here: " << gemm_engine_report().summary();
  const AttnCase& c = GetParam();
  const int64_t sq = static_cast<int64_t>(c.q_pos.size()), sk = static_cast<int64_t>(c.k_pos.size());
  const Tensor qb = to_bf16(random_tensor({c.batch, sq, c.n_h, c.d}, "q"));
  const Tensor kb = to_bf16(random_tensor({c.batch, sk, c.n_kv, c.d}, "k"));
  const Tensor vb = to_bf16(random_tensor({c.batch, sk, c.n_kv, c.d}, "v"));
  const Tensor dob = to_bf16(random_tensor({c.batch, sq, c.n_h, c.d}, "d_out"));
  const Tensor q = to_f32(qb), k = to_f32(kb), v = to_f32(vb), d_out = to_f32(dob);
  const Tensor q_pos = i32_tensor(c.q_pos), k_pos = i32_tensor(c.k_pos);
  const double scale = c.scale != 0 ? c.scale : 1.0 / std::sqrt(double(c.d));
  const AttentionArgs args{&q, &k, &v, &q_pos, &k_pos, scale, c.window};
  const AttentionArgs args_bf{&qb, &kb, &vb, &q_pos, &k_pos, scale, c.window};
  auto ref = make_reference_backend();
  auto fast = make_cpu_backend();

  const Tensor lse_shape = Tensor::empty({c.batch, c.n_h, sq}, DType::kF32, MemCategory::kActivations);
  Tensor ref_out = nan_like(q), ref_lse = nan_like(lse_shape);
  Tensor out = nan_bf16_like(q), lse = nan_like(lse_shape);
  ref->attention_forward(args, ref_out, ref_lse);
  fast->attention_forward(args_bf, out, lse);
  EXPECT_TRUE(close_to(to_f32(out), ref_out, kBf16Out, 0.0, "out"));
  EXPECT_TRUE(close_to(lse, ref_lse, kTol, kLseMinScale, "lse"));

  // Both backwards start from the reference forward, out rounded to bf16 as it is stored.
  const Tensor out_bf = to_bf16(ref_out), out_wide = to_f32(out_bf);
  Tensor ref_dq = nan_like(q), ref_dk = nan_like(k), ref_dv = nan_like(v);
  Tensor dq = nan_bf16_like(q), dk = nan_bf16_like(k), dv = nan_bf16_like(v);
  ref->attention_backward(args, out_wide, ref_lse, d_out, ref_dq, ref_dk, ref_dv);
  fast->attention_backward(args_bf, out_bf, ref_lse, dob, dq, dk, dv);
  EXPECT_TRUE(close_to(to_f32(dq), ref_dq, kBf16Grad, kCancelMinScale, "dq"));
  EXPECT_TRUE(close_to(to_f32(dk), ref_dk, kBf16Grad, kCancelMinScale, "dk"));
  EXPECT_TRUE(close_to(to_f32(dv), ref_dv, kBf16Out, 0.0, "dv"));
}

INSTANTIATE_TEST_SUITE_P(Cases, FlashAttentionBf16Parity, testing::ValuesIn(parity_cases()),
                         [](const testing::TestParamInfo<AttnCase>& p) { return p.param.name; });

testing::AssertionResult bitwise_equal(const Tensor& a, const Tensor& b, const char* what) {
  if (a.numel() == b.numel() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0)
    return testing::AssertionSuccess();
  return testing::AssertionFailure() << what << " differs";
}

// The bf16 storage decorator over a backend that does not multiply bf16 (TimedBackend answers
// matmul_takes_bf16 false, as a CPU without bf16 instructions does) widens q, k, v and runs the
// f32 kernel: bit for bit the f32 kernel on the widened inputs, outputs rounded once. Over the
// CPU backend itself (bf16 instructions here) the same call takes the bf16 kernel, which stays
// within the bf16 tolerances above of the widened result.
TEST(FlashAttentionBf16, DecoratorWidensWithoutBf16ProductsAndOtherwiseTakesTheBf16Kernel) {
  const AttnCase c = parity_cases()[4];  // s300_gqa4_d128_b2
  const int64_t sq = static_cast<int64_t>(c.q_pos.size()), sk = static_cast<int64_t>(c.k_pos.size());
  const Tensor qb = to_bf16(random_tensor({c.batch, sq, c.n_h, c.d}, "q"));
  const Tensor kb = to_bf16(random_tensor({c.batch, sk, c.n_kv, c.d}, "k"));
  const Tensor vb = to_bf16(random_tensor({c.batch, sk, c.n_kv, c.d}, "v"));
  const Tensor dob = to_bf16(random_tensor({c.batch, sq, c.n_h, c.d}, "d_out"));
  const Tensor q = to_f32(qb), k = to_f32(kb), v = to_f32(vb), d_out = to_f32(dob);
  const Tensor pos = i32_tensor(c.q_pos);
  const double scale = 1.0 / std::sqrt(double(c.d));
  const AttentionArgs args{&q, &k, &v, &pos, &pos, scale}, args_bf{&qb, &kb, &vb, &pos, &pos, scale};
  auto cpu = make_cpu_backend();
  TimedBackend timed(*cpu);
  ASSERT_FALSE(timed.matmul_takes_bf16());
  auto widening = make_bf16_storage_backend(timed);

  const Tensor lse_shape = Tensor::empty({c.batch, c.n_h, sq}, DType::kF32, MemCategory::kActivations);
  Tensor f32_out = nan_like(q), f32_lse = nan_like(lse_shape);
  cpu->attention_forward(args, f32_out, f32_lse);
  Tensor out = nan_bf16_like(q), lse = nan_like(lse_shape);
  widening->attention_forward(args_bf, out, lse);
  EXPECT_TRUE(bitwise_equal(out, to_bf16(f32_out), "widened out"));
  EXPECT_TRUE(bitwise_equal(lse, f32_lse, "widened lse"));

  const Tensor out_bf = to_bf16(f32_out), out_wide = to_f32(out_bf);
  Tensor f32_dq = nan_like(q), f32_dk = nan_like(k), f32_dv = nan_like(v);
  cpu->attention_backward(args, out_wide, f32_lse, d_out, f32_dq, f32_dk, f32_dv);
  Tensor dq = nan_bf16_like(q), dk = nan_bf16_like(k), dv = nan_bf16_like(v);
  widening->attention_backward(args_bf, out_bf, f32_lse, dob, dq, dk, dv);
  EXPECT_TRUE(bitwise_equal(dq, to_bf16(f32_dq), "widened dq"));
  EXPECT_TRUE(bitwise_equal(dk, to_bf16(f32_dk), "widened dk"));
  EXPECT_TRUE(bitwise_equal(dv, to_bf16(f32_dv), "widened dv"));

  if (!bf16_native()) GTEST_SKIP() << "widening checked; no bf16 instructions here for the bf16 kernel";
  auto native = make_bf16_storage_backend(*cpu);
  Tensor nout = nan_bf16_like(q), nlse = nan_like(lse_shape);
  native->attention_forward(args_bf, nout, nlse);
  EXPECT_FALSE(bitwise_equal(nout, out, "bf16 kernel out")) << "the decorator did not take the bf16 kernel";
  EXPECT_TRUE(close_to(to_f32(nout), to_f32(out), kBf16Out, 0.0, "bf16 kernel out vs widened"));
  Tensor ndq = nan_bf16_like(q), ndk = nan_bf16_like(k), ndv = nan_bf16_like(v);
  native->attention_backward(args_bf, out_bf, f32_lse, dob, ndq, ndk, ndv);
  EXPECT_TRUE(close_to(to_f32(ndq), to_f32(dq), kBf16Grad, kCancelMinScale, "bf16 kernel dq vs widened"));
  EXPECT_TRUE(close_to(to_f32(ndk), to_f32(dk), kBf16Grad, kCancelMinScale, "bf16 kernel dk vs widened"));
  EXPECT_TRUE(close_to(to_f32(ndv), to_f32(dv), kBf16Out, 0.0, "bf16 kernel dv vs widened"));
}

// Whole tiles behind every query's window are skipped, not computed and masked: the keys
// and values of the first k blocks (256 keys each) are NaN, and queries at 1000..1063 with a
// window of 64 see keys 937..1063 only. A computed tile would spread the NaN into out, dq, dk
// or dv even where masked (0 * NaN in P V, dS^T Q, P^T dO), so finite outputs equal to the
// reference show that blocks 0-2 were never touched. The same inputs without the window must
// produce NaN: the check can fail. f32 and (where the CPU multiplies bf16) the bf16 kernel.
TEST(FlashAttentionWindow, TilesBehindTheWindowAreNotComputed) {
  const int64_t n_h = 4, n_kv = 2, d = 32, sk = 1064, poisoned = 768, window = 64;
  const std::vector<int32_t> qp = iota_pos(64, 1000), kp = iota_pos(sk, 0);
  const Tensor q = random_tensor({1, 64, n_h, d}, "q"), d_out = random_tensor({1, 64, n_h, d}, "d_out");
  Tensor k = random_tensor({1, sk, n_kv, d}, "k"), v = random_tensor({1, sk, n_kv, d}, "v");
  std::fill_n(k.data<float>(), poisoned * n_kv * d, static_cast<float>(kNan));
  std::fill_n(v.data<float>(), poisoned * n_kv * d, static_cast<float>(kNan));
  const Tensor q_pos = i32_tensor(qp), k_pos = i32_tensor(kp);
  const AttentionArgs args{&q, &k, &v, &q_pos, &k_pos, 1.0 / std::sqrt(double(d)), window};
  auto ref = make_reference_backend();  // skips every hidden key one by one
  auto fast = make_cpu_backend();
  const Tensor lse_shape = Tensor::empty({1, n_h, 64}, DType::kF32, MemCategory::kActivations);
  Tensor ref_out = nan_like(q), ref_lse = nan_like(lse_shape), out = nan_like(q), lse = nan_like(lse_shape);
  ref->attention_forward(args, ref_out, ref_lse);
  fast->attention_forward(args, out, lse);
  EXPECT_TRUE(close_to(out, ref_out, kTol, 0.0, "out"));
  Tensor ref_dq = nan_like(q), ref_dk = nan_like(k), ref_dv = nan_like(v);
  Tensor dq = nan_like(q), dk = nan_like(k), dv = nan_like(v);
  ref->attention_backward(args, ref_out, ref_lse, d_out, ref_dq, ref_dk, ref_dv);
  fast->attention_backward(args, ref_out, ref_lse, d_out, dq, dk, dv);
  EXPECT_TRUE(close_to(dq, ref_dq, kTol, kCancelMinScale, "dq"));
  EXPECT_TRUE(close_to(dk, ref_dk, kTol, kCancelMinScale, "dk"));
  EXPECT_TRUE(close_to(dv, ref_dv, kTol, 0.0, "dv"));

  AttentionArgs full = args;
  full.window = 0;
  Tensor full_out = nan_like(q), full_lse = nan_like(lse_shape);
  fast->attention_forward(full, full_out, full_lse);
  EXPECT_TRUE(std::isnan(full_out.data<float>()[0])) << "without the window the poisoned tiles must be read";

  if (!bf16_native()) GTEST_SKIP() << "f32 checked; no bf16 instructions here for the bf16 kernel";
  const Tensor qb = to_bf16(q), kb = to_bf16(k), vb = to_bf16(v), dob = to_bf16(d_out);
  const AttentionArgs args_bf{&qb, &kb, &vb, &q_pos, &k_pos, args.scale, window};
  Tensor bout = nan_bf16_like(q), blse = nan_like(lse_shape);
  fast->attention_forward(args_bf, bout, blse);
  Tensor bdq = nan_bf16_like(q), bdk = nan_bf16_like(k), bdv = nan_bf16_like(v);
  fast->attention_backward(args_bf, to_bf16(ref_out), ref_lse, dob, bdq, bdk, bdv);
  for (const Tensor* t : {&bout, &bdq, &bdk, &bdv}) {
    const Tensor w = to_f32(*t);
    EXPECT_TRUE(std::all_of(w.data<float>(), w.data<float>() + w.numel(), [](float x) { return std::isfinite(x); }))
        << "bf16 kernel read a tile behind the window";
  }
  EXPECT_TRUE(close_to(to_f32(bout), ref_out, 0.1, 0.0, "bf16 out (finite and near the f32 reference)"));
}

struct WorkspacePeaks {
  int64_t forward, backward;  // bytes of kWorkspace above what was live before the call
};

// Runs the fast forward and backward once at sequence length S (GQA, n_kv = 2) and returns
// the peak workspace each held.
WorkspacePeaks measure_workspace(int64_t S) {
  const int64_t n_h = 4, n_kv = 2, d = 64;
  const Tensor q = random_tensor({1, S, n_h, d}, "q");
  const Tensor k = random_tensor({1, S, n_kv, d}, "k");
  const Tensor v = random_tensor({1, S, n_kv, d}, "v");
  const Tensor pos = i32_tensor(iota_pos(S, 0));
  const AttentionArgs args{&q, &k, &v, &pos, &pos, 1.0 / std::sqrt(double(d))};
  Tensor out = nan_like(q), lse = Tensor::empty({1, n_h, S}, DType::kF32, MemCategory::kActivations);
  Tensor dq = nan_like(q), dk = nan_like(k), dv = nan_like(v);
  auto fast = make_cpu_backend();
  MemoryTracker& tracker = MemoryTracker::process();
  const int64_t before = tracker.stats().current_of(MemCategory::kWorkspace);
  tracker.reset_peaks();
  fast->attention_forward(args, out, lse);
  const int64_t forward = tracker.stats().peak_of(MemCategory::kWorkspace) - before;
  tracker.reset_peaks();
  fast->attention_backward(args, out, lse, out, dq, dk, dv);
  const int64_t backward = tracker.stats().peak_of(MemCategory::kWorkspace) - before;
  EXPECT_EQ(tracker.stats().current_of(MemCategory::kWorkspace), before) << "workspace not released";
  return {forward, backward};
}

// The kernel's scratch is blocks plus one kv head's K, V (and dK, dV) packed contiguous:
// linear in S. An Sq x Sk score matrix would be S * S * 4 = 64 MiB at S = 4096 and would
// quadruple when S doubles.
TEST(FlashAttentionWorkspace, LinearInSequenceLength) {
  const WorkspacePeaks half = measure_workspace(2048), full = measure_workspace(4096);
  const int64_t S = 4096, quadratic = S * S * static_cast<int64_t>(sizeof(float));
  EXPECT_GT(full.forward, 0) << "the kernel's scratch must come from the tracked allocator";
  EXPECT_GT(full.backward, 0) << "the kernel's scratch must come from the tracked allocator";
  EXPECT_LE(full.forward, 2 * half.forward) << "forward workspace grows faster than S";
  EXPECT_LE(full.backward, 2 * half.backward) << "backward workspace grows faster than S";
  EXPECT_LT(full.forward, quadratic / 8) << "forward workspace " << full.forward << " bytes";
  EXPECT_LT(full.backward, quadratic / 8) << "backward workspace " << full.backward << " bytes";
}

}  // namespace
}  // namespace foldpar
