// The CUDA backend's many-tensor kernels (fill_many, sum_squares_many, adamw_many in
// src/backend/cuda/elementwise.cu), run on the host: launches.py turns each launch into
// shim.h's emulate_launch (every CUDA thread a std::thread), and the file's headers compile
// against host_cuda/. Each case walks a table of tensors of awkward sizes (0 and 1 element,
// one short of, exactly and one past a block's chunk, several blocks) in f32 and bf16, and
// compares with the CPU backends: fill exactly, the sums of squares within f32 rounding of
// the block partials, AdamW bit for bit against the emulated single-tensor kernel (the same
// element code) and within f32 rounding against the CPU backend. Every tensor sits in a
// larger buffer whose guard elements after it must stay untouched (the tails).
//
// Why: no GPU runs in CI; this checks the descriptor walk, the block-to-tensor search and
// the tails on every machine. tests/gpu/cuda_ops_test.cc on a GPU is the real check.
#include "elementwise_emulated.inc"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend/backend.h"
#include "core/rng.h"
#include "tensor/tensor.h"

namespace foldpar {
namespace {

using cuda::kMultiTensorChunk;

constexpr int64_t kGuard = 7;
constexpr float kGuardValue = 1536.0f;  // exact in bf16
// Block-boundary sizes: ceil(n / chunk) blocks each (13 in all), empty tensors in between.
const std::vector<int64_t> kSizes = {0, 1, kMultiTensorChunk - 1, kMultiTensorChunk, kMultiTensorChunk + 1, 300,
                                     2 * kMultiTensorChunk + 808, 0, 1, 2 * kMultiTensorChunk + 1};

// A tensor of n elements at the start of a buffer of n + kGuard, values normal(seed) and
// the guard kGuardValue.
struct Guarded {
  Tensor buffer, view;
  Guarded(int64_t n, DType dtype, uint64_t seed) {
    buffer = Tensor::empty({n + kGuard}, dtype, MemCategory::kParameters);
    std::vector<float> v(static_cast<size_t>(n + kGuard), kGuardValue);
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(normal_at(seed, 5, i));
    write_host_f32(v, buffer);
    view = buffer.narrow(0, n);
  }
  std::vector<float> values() const { return read_host_f32(view); }
  bool guard_intact() const {
    const std::vector<float> all = read_host_f32(buffer);
    for (size_t i = all.size() - kGuard; i < all.size(); ++i)
      if (all[i] != kGuardValue) return false;
    return true;
  }
};

// dtype of tensor i: every third bf16.
DType dtype_at(size_t i) { return i % 3 == 1 ? DType::kBF16 : DType::kF32; }

Tensor widened(const Tensor& t) {
  Tensor w = Tensor::empty(t.shape(), DType::kF32, MemCategory::kWorkspace);
  write_host_f32(read_host_f32(t), w);
  return w;
}

TEST(MultiTensorEmulation, FillManyWritesEveryTensorAndNothingElse) {
  std::vector<Guarded> ts;
  std::vector<cuda::FillSlot> slots;
  for (size_t i = 0; i < kSizes.size(); ++i) ts.emplace_back(kSizes[i], dtype_at(i), i);
  for (Guarded& t : ts) slots.push_back({{t.view.raw_data(), t.view.dtype()}, t.view.numel()});
  std::vector<unsigned char> workspace(cuda::fill_many_workspace_bytes(static_cast<int64_t>(slots.size())));
  cuda::launch_fill_many(-0.3, slots.data(), static_cast<int64_t>(slots.size()), workspace.data(), nullptr);
  auto cpu = make_cpu_backend();
  for (size_t i = 0; i < ts.size(); ++i) {
    Tensor want = Tensor::empty({kSizes[i]}, DType::kF32, MemCategory::kWorkspace);
    cpu->fill(-0.3, want);
    const std::vector<float> w = read_host_f32(want), got = ts[i].values();
    for (size_t j = 0; j < got.size(); ++j) {
      const float expect = dtype_at(i) == DType::kBF16 ? bf16_to_f32(f32_to_bf16(w[j])) : w[j];
      ASSERT_EQ(got[j], expect) << "tensor " << i << " element " << j;
    }
    EXPECT_TRUE(ts[i].guard_intact()) << "tensor " << i;
  }
}

TEST(MultiTensorEmulation, SumSquaresManyMatchesTheCpuBackendPerTensor) {
  std::vector<Guarded> ts;
  std::vector<cuda::SumSquaresSlot> slots;
  for (size_t i = 0; i < kSizes.size(); ++i) ts.emplace_back(kSizes[i], dtype_at(i), 100 + i);
  for (Guarded& t : ts) slots.push_back({{t.view.raw_data(), t.view.dtype()}, t.view.numel()});
  const int64_t count = static_cast<int64_t>(slots.size());
  // Garbage where the totals go: the launcher must zero them.
  std::vector<unsigned char> workspace(cuda::sum_squares_many_workspace_bytes(count), 0xff);
  std::vector<double> got(slots.size(), NAN);
  cuda::sum_squares_many(slots.data(), count, workspace.data(), got.data(), nullptr);
  auto cpu = make_cpu_backend();
  for (size_t i = 0; i < ts.size(); ++i) {
    const double want = cpu->sum_squares(widened(ts[i].view));
    // f32 partials over at most one chunk per block: relative error below chunk * 2^-24.
    EXPECT_NEAR(got[i], want, 1e-6 * want) << "tensor " << i << " of " << kSizes[i];
    if (kSizes[i] == 0) {
      EXPECT_EQ(got[i], 0.0);
    }
  }
  // All tensors empty: no launch, zeros.
  std::vector<cuda::SumSquaresSlot> empty = {{{nullptr, DType::kF32}, 0}, {{nullptr, DType::kBF16}, 0}};
  std::vector<double> zeros = {NAN, NAN};
  cuda::sum_squares_many(empty.data(), 2, workspace.data(), zeros.data(), nullptr);
  EXPECT_EQ(zeros[0], 0.0);
  EXPECT_EQ(zeros[1], 0.0);
}

// AdamW operands of one tensor; grad and param dtypes as given, moments like param.
// `rounded`: a bf16 copy of the updated param (the bf16 parameter of an f32 master).
struct AdamWSet {
  Guarded grad, param, m, v, rounded;
  AdamWSet(int64_t n, DType grad_dtype, DType param_dtype, uint64_t seed)
      : grad(n, grad_dtype, seed), param(n, param_dtype, seed + 1), m(n, param_dtype, seed + 2),
        v(n, param_dtype, seed + 3), rounded(n, DType::kBF16, seed + 4) {
    // v must not be negative: its square root is taken.
    std::vector<float> vv = v.values();
    for (float& x : vv) x = x * x;
    write_host_f32(vv, v.view);
  }
  cuda::AdamWSlot slot(float weight_decay, bool round) {
    return {{grad.view.raw_data(), grad.view.dtype()},
            {param.view.raw_data(), param.view.dtype()},
            {m.view.raw_data(), m.view.dtype()},
            {v.view.raw_data(), v.view.dtype()},
            param.view.numel(),
            weight_decay,
            {round ? rounded.view.raw_data() : nullptr, DType::kBF16}};
  }
};

TEST(MultiTensorEmulation, AdamWManyEqualsTheSingleTensorKernelAndTheCpuBackend) {
  Backend::AdamWStep s;
  s.lr = 1e-2;
  s.weight_decay = 0.1;
  s.grad_scale = 0.7;
  s.step = 3;
  const cuda::AdamWArgs a{static_cast<float>(s.lr),           static_cast<float>(s.beta1),
                          static_cast<float>(s.beta2),        static_cast<float>(s.eps),
                          static_cast<float>(s.weight_decay), static_cast<float>(s.grad_scale),
                          static_cast<float>(1.0 - std::pow(s.beta1, 3.0)),
                          static_cast<float>(1.0 - std::pow(s.beta2, 3.0))};
  // Two identical sets: the many-tensor kernel on one, the single-tensor kernel on the other.
  // bf16 gradients with f32 parameters (f32 masters), and all-bf16 ones.
  std::vector<AdamWSet> many, single;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    const DType g = dtype_at(i), p = i % 4 == 3 ? DType::kBF16 : DType::kF32;
    many.emplace_back(kSizes[i], g, p, 10 * i);
    single.emplace_back(kSizes[i], g, p, 10 * i);
  }
  auto decay = [](size_t i) { return i % 2 == 0; };
  auto round = [](size_t i) { return i % 3 != 2; };  // the others' `rounded` must stay untouched
  std::vector<cuda::AdamWSlot> slots;
  for (size_t i = 0; i < many.size(); ++i)
    slots.push_back(many[i].slot(decay(i) ? a.weight_decay : 0.0f, round(i)));
  const int64_t count = static_cast<int64_t>(slots.size());
  std::vector<unsigned char> workspace(cuda::adamw_many_workspace_bytes(count));
  cuda::launch_adamw_many(a, slots.data(), count, workspace.data(), nullptr);

  auto cpu = make_cpu_backend();
  for (size_t i = 0; i < single.size(); ++i) {
    AdamWSet& one = single[i];
    // The CPU backend's reference on f32 copies, taken before the single-tensor kernel runs.
    Tensor g = widened(one.grad.view), p = widened(one.param.view), m = widened(one.m.view), v = widened(one.v.view);
    Backend::AdamWStep si = s;
    if (!decay(i)) si.weight_decay = 0;
    cpu->adamw_update(si, g, p, m, v);
    cuda::AdamWArgs ai = a;
    ai.weight_decay = static_cast<float>(si.weight_decay);
    cuda::AdamWSlot sl = one.slot(0, false);
    cuda::launch_adamw(ai, sl.grad, sl.param, sl.m, sl.v, sl.n, nullptr);

    const bool bf16_param = one.param.view.dtype() == DType::kBF16;
    const Guarded* got[3] = {&many[i].param, &many[i].m, &many[i].v};
    const Guarded* same[3] = {&one.param, &one.m, &one.v};
    const Tensor* cpu_out[3] = {&p, &m, &v};
    for (int k = 0; k < 3; ++k) {
      const std::vector<float> x = got[k]->values(), y = same[k]->values(), c = read_host_f32(*cpu_out[k]);
      for (size_t j = 0; j < x.size(); ++j) {
        ASSERT_EQ(x[j], y[j]) << "tensor " << i << " operand " << k << " element " << j;
        // The CPU backend multiplies by 1/c1 where the kernel divides: f32 rounding apart
        // (bf16 storage: the kernel's result rounded to bf16).
        const double tol = bf16_param ? 1e-2 * std::abs(c[j]) + 1e-6 : 1e-5 * std::abs(c[j]) + 1e-7;
        ASSERT_NEAR(x[j], c[j], tol) << "tensor " << i << " operand " << k << " element " << j;
      }
      EXPECT_TRUE(got[k]->guard_intact()) << "tensor " << i << " operand " << k;
    }
    EXPECT_TRUE(many[i].grad.guard_intact() && many[i].grad.values() == one.grad.values()) << "grad " << i;
    // The rounded copy: the updated param converted to bf16 (round to nearest even), or,
    // without a rounded slot, its initial values.
    const std::vector<float> r = many[i].rounded.values(), updated = many[i].param.values(),
                             untouched = single[i].rounded.values();
    for (size_t j = 0; j < r.size(); ++j)
      ASSERT_EQ(r[j], round(i) ? bf16_to_f32(f32_to_bf16(updated[j])) : untouched[j])
          << "tensor " << i << " rounded element " << j;
    EXPECT_TRUE(many[i].rounded.guard_intact()) << "tensor " << i << " rounded";
  }
}

}  // namespace
}  // namespace foldpar
