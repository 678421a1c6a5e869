// The CUDA backend's attention merge (src/backend/cuda/attention_merge.cu, the ring
// attention's and TSP's online-softmax merge of two partial results), run on the host:
// launches.py turns the launch into shim.h's emulate_launch, and the file compiles against
// host_cuda/. Checked against the merge's definition in f64 (backend.h) and against the CPU
// backend, in f32 and bf16 outputs, with rows that neither side saw (lse -inf), rows only
// the block saw, rows only the earlier result saw, and more rows than one block's threads.
//
// Why: no GPU runs in CI; this checks the kernel's indexing (the [B, Sq, n_h, d] output
// against the [B, n_h, Sq] lse) and its -inf cases on every machine.
#include "attention_merge_emulated.inc"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "backend/backend.h"
#include "core/rng.h"
#include "tensor/tensor.h"

namespace foldpar {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Case {
  int64_t B, Sq, n_h, d;
};

// lse values: mostly finite, and some -inf (index-determined so both sides get each case).
float lse_at(uint64_t seed, int64_t i) {
  if (i % 7 == 3) return kNegInf;
  return static_cast<float>(2.0 * normal_at(seed, 1, static_cast<uint64_t>(i)));
}

Tensor values(const Shape& shape, DType dtype, uint64_t seed) {
  Tensor t = Tensor::empty(shape, dtype, MemCategory::kWorkspace);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(normal_at(seed, 2, i));
  write_host_f32(v, t);
  return t;
}

Tensor lse_tensor(const Shape& shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::kF32, MemCategory::kWorkspace);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = lse_at(seed, static_cast<int64_t>(i));
  write_host_f32(v, t);
  return t;
}

void run_case(const Case& c, DType dtype) {
  const Shape out_shape = {c.B, c.Sq, c.n_h, c.d};
  const Shape lse_shape = {c.B, c.n_h, c.Sq};
  Tensor block_out = values(out_shape, dtype, 1), out = values(out_shape, dtype, 2);
  Tensor block_lse = lse_tensor(lse_shape, 3), lse = lse_tensor(lse_shape, 4);
  // Inputs as the kernel sees them (bf16 already rounded), before it overwrites out and lse.
  const std::vector<float> bo = read_host_f32(block_out), o0 = read_host_f32(out), bl = read_host_f32(block_lse),
                           l0 = read_host_f32(lse);
  cuda::launch_attention_merge({block_out.raw_data(), dtype}, block_lse.data<float>(), {out.raw_data(), dtype},
                               lse.data<float>(), c.B, c.Sq, c.n_h, c.d, nullptr);
  const std::vector<float> o = read_host_f32(out), l = read_host_f32(lse);

  // The CPU backend on f32 copies of the same inputs.
  auto cpu = make_cpu_backend();
  Tensor cpu_out = Tensor::empty(out_shape, DType::kF32, MemCategory::kWorkspace);
  Tensor cpu_bo = Tensor::empty(out_shape, DType::kF32, MemCategory::kWorkspace);
  Tensor cpu_lse = Tensor::empty(lse_shape, DType::kF32, MemCategory::kWorkspace);
  write_host_f32(o0, cpu_out);
  write_host_f32(bo, cpu_bo);
  write_host_f32(l0, cpu_lse);
  cpu->attention_merge(cpu_bo, block_lse, cpu_out, cpu_lse);
  const std::vector<float> co = read_host_f32(cpu_out), cl = read_host_f32(cpu_lse);

  // bf16 outputs: one rounding of the f32 result (2^-8 relative, 2^-7 allowed).
  const double tol = dtype == DType::kBF16 ? 1.0 / 128 : 1e-6;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.n_h; ++h)
      for (int64_t i = 0; i < c.Sq; ++i) {
        const size_t li = static_cast<size_t>((b * c.n_h + h) * c.Sq + i);
        const size_t oi = static_cast<size_t>(((b * c.Sq + i) * c.n_h + h) * c.d);
        const std::string where = "b " + std::to_string(b) + " h " + std::to_string(h) + " i " + std::to_string(i);
        if (bl[li] == kNegInf) {  // the block saw nothing: untouched
          ASSERT_EQ(l[li], l0[li]) << where;
          for (int64_t e = 0; e < c.d; ++e) ASSERT_EQ(o[oi + e], o0[oi + e]) << where;
          continue;
        }
        if (l0[li] == kNegInf) {  // nothing before: the block's result, exactly
          ASSERT_EQ(l[li], bl[li]) << where;
          for (int64_t e = 0; e < c.d; ++e) ASSERT_EQ(o[oi + e], bo[oi + e]) << where;
          continue;
        }
        const double m = std::max<double>(l0[li], bl[li]);
        const double ea = std::exp(l0[li] - m), ec = std::exp(bl[li] - m);
        ASSERT_NEAR(l[li], m + std::log(ea + ec), 1e-6 * std::abs(m) + 1e-6) << where;
        ASSERT_NEAR(l[li], cl[li], 1e-6 * std::abs(m) + 1e-6) << where << " (CPU backend)";
        for (int64_t e = 0; e < c.d; ++e) {
          const double want = (ea * o0[oi + e] + ec * bo[oi + e]) / (ea + ec);
          // Relative to the terms' magnitudes (they may cancel): the weights and products
          // round in f32 (a few 2^-24), and a bf16 output once more.
          const double scale = (ea * std::abs(o0[oi + e]) + ec * std::abs(bo[oi + e])) / (ea + ec) + 1e-30;
          ASSERT_NEAR(o[oi + e], want, tol * scale) << where << " e " << e;
          ASSERT_NEAR(o[oi + e], co[oi + e], tol * scale) << where << " e " << e << " (CPU)";
        }
      }
}

TEST(MergeEmulation, MatchesTheDefinitionAndTheCpuBackendInF32) {
  run_case({2, 5, 3, 7}, DType::kF32);
  run_case({1, 300, 2, 4}, DType::kF32);  // 600 rows: three blocks of 256 threads
}

TEST(MergeEmulation, MatchesTheDefinitionInBf16) { run_case({2, 9, 2, 8}, DType::kBF16); }

}  // namespace
}  // namespace foldpar
