// The GEMM engines (backend/cpu/gemm_engine.h) against the reference backend (fp64
// accumulation): every engine, every transpose pair the model uses, alpha and beta, awkward
// sizes and the shape classes of configs/small.json; bf16 x bf16 -> f32/bf16 products
// within a bound derived from bf16's precision; the routing's promises; and the start-up
// self-check's report, which the ctest entry "unit.gemm_engine_prescott" reruns with
// OPENBLAS_CORETYPE=Prescott forced.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "backend/backend.h"
#include "backend/bf16_storage_backend.h"
#include "backend/cpu/gemm_engine.h"
#include "core/tolerance.h"
#include "test_util.h"

namespace foldpar {
namespace {

using testing::near_rel;
using testing::random_tensor;

struct Dims {
  int64_t m, n, k;
};

Tensor ws(const Shape& s, DType t) { return Tensor::empty(s, t, MemCategory::kWorkspace); }
// a as stored: [k, m] when transposed, else [m, k]; b: [n, k] when transposed, else [k, n].
Tensor operand_a(Dims c, bool ta, uint64_t seed) {
  return random_tensor(ta ? Shape{c.k, c.m} : Shape{c.m, c.k}, DType::kF32, seed);
}
Tensor operand_b(Dims c, bool tb, uint64_t seed) {
  return random_tensor(tb ? Shape{c.n, c.k} : Shape{c.k, c.n}, DType::kF32, seed);
}

// Awkward sizes: 1 (a vector), 3 (below every vector width), 17 (one past 16 floats), 257
// (one past a 256 block), each in every role: all triples of {1, 3, 17}, and 257 as m, n or
// k beside 3 or 17 (the reference's cost keeps 257 to one dimension at a time); decode's few
// rows (2, 4) meet the skinny kernel's pairs and tails.
std::vector<Dims> awkward_dims() {
  std::vector<Dims> out;
  for (int64_t m : {1, 3, 17})
    for (int64_t n : {1, 3, 17})
      for (int64_t k : {1, 3, 17}) out.push_back({m, n, k});
  for (int64_t x : {3, 17})
    for (int64_t y : {1, 17}) {
      out.push_back({257, x, y});
      out.push_back({x, 257, y});
      out.push_back({x, y, 257});
    }
  for (Dims d : {Dims{2, 37, 515}, Dims{4, 64, 9}, Dims{5, 9, 48}}) out.push_back(d);
  // m and k multiples of 64: oneDNN's primitive built for the shape (every other extent above
  // leaves m or k to run time: gemm_engine.cc, runtime_extent).
  for (Dims d : {Dims{64, 17, 128}, Dims{128, 3, 64}}) out.push_back(d);
  return out;
}

// The products of a training step of configs/small.json (h 512, f 1376, V 256) at T = 33
// tokens (the reference's cost is T h f), in the three transposes: NT forward x W^T, NN data
// gradient dy W, TN weight gradient dy^T x; and decode's NT at 1 and 4 rows.
struct Product {
  Dims d;
  bool ta, tb;
};
std::vector<Product> model_products() {
  const int64_t T = 33, h = 512, f = 1376, V = 256;
  std::vector<Product> out;
  for (auto [in, o] : {std::pair{h, h}, std::pair{h, f}, std::pair{f, h}, std::pair{h, V}}) {
    out.push_back({{T, o, in}, false, true});
    out.push_back({{T, in, o}, false, false});
    out.push_back({{o, in, T}, true, false});
  }
  out.push_back({{1, f, h}, false, true});
  out.push_back({{4, f, h}, false, true});
  return out;
}

std::vector<GemmEngine> engines_for(bool ta) {
  std::vector<GemmEngine> e = {GemmEngine::kAuto, GemmEngine::kOneDnn, GemmEngine::kOpenBlas};
  if (!ta) e.push_back(GemmEngine::kSkinny);
  return e;
}

// Every engine that takes this transpose against the reference, for three betas. The
// reference product is taken once (beta 0) and beta * c0 added to it in double: the
// reference backend's loops are most of this file's time under the sanitizers.
void expect_engines_match_reference(Dims c, bool ta, bool tb, Backend& ref) {
  const Tensor a = operand_a(c, ta, 1), b = operand_b(c, tb, 2), c0 = random_tensor({c.m, c.n}, DType::kF32, 3);
  const MatmulDims d = check_matmul(a, ta, b, tb, c0);
  Tensor product = c0.clone(MemCategory::kWorkspace);
  ref.matmul(a, ta, b, tb, product, 0.75f, 0.0f);
  for (float beta : {0.0f, 1.0f, 0.5f}) {
    Tensor want = c0.clone(MemCategory::kWorkspace);
    for (int64_t i = 0; i < want.numel(); ++i)
      want.data<float>()[i] = static_cast<float>(double{product.data<float>()[i]} + double{beta} * c0.data<float>()[i]);
    for (GemmEngine e : engines_for(ta)) {
      Tensor got = c0.clone(MemCategory::kWorkspace);
      gemm_f32(e, d, ta, tb, a.data<float>(), b.data<float>(), got.data<float>(), 0.75f, beta);
      EXPECT_TRUE(near_rel(got, want, tol::kF32Op))
          << gemm_engine_name(e) << " " << c.m << "x" << c.n << "x" << c.k << " ta=" << ta << " tb=" << tb
          << " beta=" << beta;
    }
  }
}

TEST(GemmEngine, EveryEngineAndTransposeOnAwkwardSizes) {
  auto ref = make_reference_backend();
  for (Dims c : awkward_dims())
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) expect_engines_match_reference(c, ta, tb, *ref);
}

TEST(GemmEngine, EveryEngineOnTheModelsShapeClasses) {
  auto ref = make_reference_backend();
  for (const Product& p : model_products()) expect_engines_match_reference(p.d, p.ta, p.tb, *ref);
}

TEST(GemmEngine, BetaZeroIgnoresNaNOnEveryEngine) {
  for (bool tb : {false, true})
    for (GemmEngine e : engines_for(false))
      for (int64_t m : {2, 5, 64}) {
        const Tensor a = random_tensor({m, 3}, DType::kF32, 1), b = operand_b({m, 5, 3}, tb, 2);
        Tensor c = ws({m, 5}, DType::kF32);
        std::fill_n(c.data<float>(), c.numel(), std::numeric_limits<float>::quiet_NaN());
        gemm_f32(e, check_matmul(a, false, b, tb, c), false, tb, a.data<float>(), b.data<float>(), c.data<float>(), 1, 0);
        for (int64_t i = 0; i < c.numel(); ++i) EXPECT_FALSE(std::isnan(c.data<float>()[i])) << gemm_engine_name(e) << m;
      }
}

// The backend's own entry point: k = 0 scales c by beta, and every shape class goes through.
TEST(GemmEngine, CpuBackendMatmulRoutesEveryShapeClass) {
  auto cpu = make_cpu_backend();
  auto ref = make_reference_backend();
  for (const Product& p : model_products()) {
    const Tensor a = operand_a(p.d, p.ta, 4), b = operand_b(p.d, p.tb, 5);
    Tensor got = random_tensor({p.d.m, p.d.n}, DType::kF32, 6), want = got.clone(MemCategory::kWorkspace);
    cpu->matmul(a, p.ta, b, p.tb, got, 1.0f, 1.0f);
    ref->matmul(a, p.ta, b, p.tb, want, 1.0f, 1.0f);
    EXPECT_TRUE(near_rel(got, want, tol::kF32Op)) << p.d.m << "x" << p.d.n << "x" << p.d.k;
  }
  // k = 0: a stored [k, m] = [0, 3] (a [3, 0] would read as 0 rows).
  Tensor a = ws({0, 3}, DType::kF32), b = ws({0, 2}, DType::kF32);
  Tensor c = random_tensor({3, 2}, DType::kF32, 7), want = c.clone(MemCategory::kWorkspace);
  cpu->matmul(a, true, b, false, c, 1.0f, 0.5f);
  ref->matmul(a, true, b, false, want, 1.0f, 0.5f);
  EXPECT_TRUE(near_rel(c, want, 0.0));
}

// A MoE expert's rows change every call: products whose m or k is not a multiple of 64 share
// one primitive per family (the other dims, transposes, types), built once, instead of a JIT
// compilation per new extent; multiples of 64 (a model's token counts) get their own.
TEST(GemmEngine, VaryingRowsBuildOnePrimitive) {
  auto ref = make_reference_backend();
  // As the model multiplies: NT x W^T with the rows as m; TN dy^T x with the rows as k, both
  // operands [rows, ...] so no leading dimension varies.
  const auto product = [&](int64_t m, int64_t k, bool ta) {
    const Dims c{m, 48, k};
    const bool tb = !ta;
    const Tensor a = operand_a(c, ta, 21), b = operand_b(c, tb, 22);
    Tensor got = ws({m, 48}, DType::kF32), want = ws({m, 48}, DType::kF32);
    gemm_f32(GemmEngine::kOneDnn, check_matmul(a, ta, b, tb, got), ta, tb, a.data<float>(), b.data<float>(),
             got.data<float>(), 1.0f, 0.0f);
    ref->matmul(a, ta, b, tb, want);
    EXPECT_TRUE(near_rel(got, want, tol::kF32Op)) << m << "x48x" << k << " ta=" << ta;
  };
  product(5, 96, false);  // the family's primitive, built here if no earlier test did
  product(96, 5, true);
  const int64_t before = onednn_primitives_built();
  for (int64_t rows = 6; rows < 40; ++rows) {
    product(rows, 96, false);  // rows as m (an expert's forward, its data gradient)
    product(96, rows, true);   // rows as k (its weight gradient)
  }
  EXPECT_EQ(onednn_primitives_built(), before);
  for (int64_t rows : {64, 128, 192}) product(rows, 96, false);
  EXPECT_EQ(onednn_primitives_built(), before + 3);  // one per shape
}

// ---- bf16 ----

Tensor to_dtype(const Tensor& t, DType d) { return t.to(d, MemCategory::kWorkspace); }
Tensor abs_of(const Tensor& t) {  // f64
  Tensor out = to_dtype(t, DType::kF64);
  for (int64_t i = 0; i < out.numel(); ++i) out.data<double>()[i] = std::abs(out.data<double>()[i]);
  return out;
}
double value_at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::kBF16 ? bf16_to_f32(t.data<bf16>()[i]) : t.data<float>()[i];
}

// One bf16 product against the fp64 reference of the UNROUNDED f32 operands, element by
// element. The bound, from bf16's unit roundoff u = 2^-8 (8 significant bits):
//  - rounding a and b to bf16 moves each product a_ik b_kj by at most (2u + u^2) |a_ik b_kj|;
//  - f32 accumulation of K exact products (bf16 x bf16 fits in f32's 24 bits) adds at most
//    K 2^-24 per unit of sum |a_ik b_kj| (the worst case of sequential summation; blocked
//    orders do better) — the growth with K;
//  - a bf16 output is rounded once more: u |c|.
// So |got - want| <= (2u + u^2 + K 2^-24) alpha sum_k |a_ik||b_kj| + (K 2^-24) |beta c0|
//                    + [bf16 c] u (|want| + 2u alpha sum_k |a_ik||b_kj|).
// c0 holds bf16-exact values, so beta c0 carries no input rounding.
void expect_bf16_products_within_bound(Backend& be, Backend& ref, Dims c, bool ta, bool tb, float alpha, float beta) {
  constexpr double u = 1.0 / 256, f32_u = 1.0 / (1 << 24);
  const Tensor a = operand_a(c, ta, 11), b = operand_b(c, tb, 12);
  const Tensor c0 = to_dtype(to_dtype(random_tensor({c.m, c.n}, DType::kF32, 13), DType::kBF16), DType::kF32);
  Tensor want = to_dtype(c0, DType::kF64), mag = ws({c.m, c.n}, DType::kF64);
  ref.matmul(to_dtype(a, DType::kF64), ta, to_dtype(b, DType::kF64), tb, want, alpha, beta);
  ref.matmul(abs_of(a), ta, abs_of(b), tb, mag, std::abs(alpha), 0.0f);  // alpha sum |a||b|
  const Tensor a16 = to_dtype(a, DType::kBF16), b16 = to_dtype(b, DType::kBF16);
  for (DType c_dtype : {DType::kF32, DType::kBF16}) {
    Tensor got = to_dtype(c0, c_dtype);
    be.matmul(a16, ta, b16, tb, got, alpha, beta);
    ASSERT_EQ(got.dtype(), c_dtype);
    const bool bf16_out = c_dtype == DType::kBF16;
    int reported = 0;
    for (int64_t i = 0; i < got.numel(); ++i) {
      const double w = want.data<double>()[i], s = mag.data<double>()[i];
      const double bound = (2 * u + u * u + c.k * f32_u) * s + c.k * f32_u * std::abs(beta * c0.data<float>()[i]) +
                           (bf16_out ? u * (std::abs(w) + 2 * u * s) : 0.0);
      const double err = std::abs(value_at(got, i) - w);
      if (err > bound && reported++ < 5)
        ADD_FAILURE() << be.name() << " " << c.m << "x" << c.n << "x" << c.k << " ta=" << ta << " tb=" << tb
                      << " c " << dtype_name(c_dtype) << " beta " << beta << ": element " << i << " got "
                      << value_at(got, i) << " want " << w << " |err| " << err << " > bound " << bound;
    }
  }
}

void expect_bf16_everywhere(Backend& be) {
  auto ref = make_reference_backend();
  for (Dims c : awkward_dims())
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (float beta : {0.0f, 1.0f}) expect_bf16_products_within_bound(be, *ref, c, ta, tb, 0.75f, beta);
  for (const Product& p : model_products()) expect_bf16_products_within_bound(be, *ref, p.d, p.ta, p.tb, 1.0f, 1.0f);
}

TEST(GemmEngineBf16, NativeProductsWithinBf16Bound) {
  auto cpu = make_cpu_backend();
  if (!cpu->matmul_takes_bf16()) GTEST_SKIP() << "no bf16 instructions here: " << gemm_engine_report().summary();
  expect_bf16_everywhere(*cpu);
}

// What `train --bf16` runs: the decorator over the CPU backend (native where the CPU has
// bf16 instructions, widened elsewhere); the same bound holds for both.
TEST(GemmEngineBf16, StorageDecoratorWithinBf16Bound) {
  auto cpu = make_cpu_backend();
  auto bf = make_bf16_storage_backend(*cpu);
  EXPECT_EQ(bf->matmul_takes_bf16(), cpu->matmul_takes_bf16());
  expect_bf16_everywhere(*bf);
}

TEST(GemmEngineBf16, DecoratorPassesBf16OperandsToANativeBackend) {
  auto cpu = make_cpu_backend();
  if (!cpu->matmul_takes_bf16()) GTEST_SKIP() << "no bf16 instructions here: " << gemm_engine_report().summary();
  auto bf = make_bf16_storage_backend(*cpu);
  const Tensor a = to_dtype(random_tensor({33, 70}, DType::kF32, 1), DType::kBF16);
  const Tensor b = to_dtype(random_tensor({19, 70}, DType::kF32, 2), DType::kBF16);
  Tensor c1 = to_dtype(random_tensor({33, 19}, DType::kF32, 3), DType::kBF16), c2 = c1.clone(MemCategory::kWorkspace);
  cpu->matmul(a, false, b, true, c1, 1.0f, 1.0f);
  bf->matmul(a, false, b, true, c2, 1.0f, 1.0f);
  EXPECT_EQ(max_rel_error(c2, c1), 0.0);  // the same kernel on the same operands
}

// ---- routing and the self-check ----

TEST(GemmEngineRouting, NoProductGoesToAnOpenBlasSlowerThanTheCpu) {
  const GemmEngineReport& r = gemm_engine_report();
  for (const Product& p : model_products()) {
    const MatmulDims d{p.d.m, p.d.n, p.d.k, p.ta ? p.d.m : p.d.k, p.tb ? p.d.k : p.d.n};
    const GemmEngine e = choose_f32_engine(d, p.ta, p.tb);
    EXPECT_NE(e, GemmEngine::kAuto);
    if (!r.openblas_matches_cpu) {
      EXPECT_NE(e, GemmEngine::kOpenBlas) << r.summary();
    }
    if (e == GemmEngine::kSkinny) {
      EXPECT_FALSE(p.ta);
    }
  }
}

TEST(GemmEngineReport, NamesTheLibrariesChoices) {
  const GemmEngineReport& r = gemm_engine_report();
  EXPECT_FALSE(r.cpu_isa.empty());
  EXPECT_NE(r.onednn_isa, "unknown");
  EXPECT_FALSE(r.openblas_core.empty());
  EXPECT_EQ(r.f32_engine, r.openblas_matches_cpu ? "openblas" : "onednn");
  EXPECT_EQ(r.openblas_fix.empty(), r.openblas_matches_cpu);
  const std::string s = r.summary();
  EXPECT_NE(s.find("gemm " + r.f32_engine + " (onednn isa " + r.onednn_isa + ")"), std::string::npos) << s;
  EXPECT_NE(s.find("openblas core " + r.openblas_core), std::string::npos) << s;
}

// Run by ctest with OPENBLAS_CORETYPE=Prescott (unit.gemm_engine_prescott): OpenBLAS loads
// its SSE3 kernels, and on any CPU with AVX or better the report must say so, name the fix,
// and keep every f32 product on oneDNN.
TEST(GemmEngineReport, ForcedPrescottCoreIsReportedAndUnused) {
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (forced == nullptr || std::string(forced) != "Prescott") GTEST_SKIP() << "needs OPENBLAS_CORETYPE=Prescott";
  const GemmEngineReport& r = gemm_engine_report();
  ASSERT_EQ(r.openblas_core, "Prescott");
  if (r.cpu_isa == "sse" || r.cpu_isa == "non-x86") GTEST_SKIP() << "Prescott is this CPU's own core: " << r.cpu_isa;
  EXPECT_FALSE(r.openblas_matches_cpu);
  EXPECT_EQ(r.f32_engine, "onednn");
  EXPECT_NE(r.openblas_fix.find("OPENBLAS_CORETYPE="), std::string::npos);
  const std::string s = r.summary();
  EXPECT_NE(s.find("gemm onednn (onednn isa " + r.onednn_isa + ")"), std::string::npos) << s;
  EXPECT_NE(s.find("openblas core Prescott (slow for this cpu: unused"), std::string::npos) << s;
}

}  // namespace
}  // namespace foldpar
