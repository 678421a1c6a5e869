// bf16 storage: the decorator passes f32 through untouched and computes bf16 operands in
// f32; a whole model stored in bf16 (weights and activations, f32 gradients and per-row
// statistics) stays within bf16's precision of the f32 model and halves the activations.
#include <gtest/gtest.h>

#include <cstring>

#include "backend/bf16_storage_backend.h"
#include "model/llama_model.h"
#include "test_util.h"

namespace foldpar {
namespace {

using testing::near_rel;
using testing::random_tensor;

TEST(Bf16Storage, F32PassesThroughBitForBit) {
  auto cpu = make_cpu_backend();
  auto bf = make_bf16_storage_backend(*cpu);
  Tensor a = random_tensor({7, 5}, DType::kF32, 1), b = random_tensor({5, 3}, DType::kF32, 2);
  Tensor c1 = Tensor::empty({7, 3}, DType::kF32, MemCategory::kWorkspace), c2 = c1.clone(MemCategory::kWorkspace);
  cpu->matmul(a, false, b, false, c1);
  bf->matmul(a, false, b, false, c2);
  EXPECT_EQ(max_rel_error(c1, c2), 0.0);
}

TEST(Bf16Storage, Bf16OperandsAreWidenedAndResultsRoundedOnce) {
  auto cpu = make_cpu_backend();
  auto bf = make_bf16_storage_backend(*cpu);
  const Tensor a = random_tensor({9, 4}, DType::kF32, 3).to(DType::kBF16, MemCategory::kWorkspace);
  const Tensor b = random_tensor({4, 6}, DType::kF32, 4).to(DType::kBF16, MemCategory::kWorkspace);
  Tensor c = random_tensor({9, 6}, DType::kF32, 5).to(DType::kBF16, MemCategory::kWorkspace);
  // Expected: the f32 op on the widened values, accumulating into the widened old c, rounded.
  Tensor want = c.to(DType::kF32, MemCategory::kWorkspace);
  cpu->matmul(a.to(DType::kF32, MemCategory::kWorkspace), false, b.to(DType::kF32, MemCategory::kWorkspace), false,
              want, 1.0f, 1.0f);
  bf->matmul(a, false, b, false, c, 1.0f, 1.0f);
  ASSERT_EQ(c.dtype(), DType::kBF16);
  EXPECT_EQ(max_rel_error(c, want.to(DType::kBF16, MemCategory::kWorkspace)), 0.0);
  // A mixed op: bf16 activations, f32 statistics out.
  const Tensor x = random_tensor({3, 8}, DType::kF32, 6).to(DType::kBF16, MemCategory::kWorkspace);
  const Tensor w = random_tensor({8}, DType::kF32, 7);
  Tensor y = Tensor::empty({3, 8}, DType::kBF16, MemCategory::kWorkspace);
  Tensor rstd = Tensor::empty({3}, DType::kF32, MemCategory::kWorkspace), rstd_want = rstd.clone(MemCategory::kWorkspace);
  Tensor y_want = Tensor::empty({3, 8}, DType::kF32, MemCategory::kWorkspace);
  bf->rmsnorm_forward(x, w, 1e-5, y, rstd);
  cpu->rmsnorm_forward(x.to(DType::kF32, MemCategory::kWorkspace), w, 1e-5, y_want, rstd_want);
  EXPECT_EQ(max_rel_error(rstd, rstd_want), 0.0);
  EXPECT_EQ(max_rel_error(y, y_want.to(DType::kBF16, MemCategory::kWorkspace)), 0.0);
}

// The token-wise ops (Backend::tokenwise_takes_bf16): the CPU backend on bf16 tensors (and
// f32 / bf16 mixes) against the same backend's f32 op on the widened values, rounded once:
// the same bits, which is what lets the decorator pass bf16 tensors straight through. Sizes
// span several of the backend's runs (4096 elements) with a remainder.
Tensor bf(const Shape& shape, uint64_t seed) {
  return random_tensor(shape, DType::kF32, seed).to(DType::kBF16, MemCategory::kWorkspace);
}
Tensor f32(const Tensor& t) { return t.to(DType::kF32, MemCategory::kWorkspace); }
Tensor rounded(const Tensor& t) { return t.to(DType::kBF16, MemCategory::kWorkspace); }
void expect_same_bits(const Tensor& got, const Tensor& want, const char* what) {
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const size_t bytes = static_cast<size_t>(got.numel()) * dtype_size(got.dtype());
  EXPECT_EQ(std::memcmp(got.raw_data(), want.raw_data(), bytes), 0) << what << ": not the same bits";
}

TEST(Bf16Tokenwise, Bf16OperandsGiveTheWidenedF32OpsBitsRoundedOnce) {
  auto cpu = make_cpu_backend();
  const Shape flat{3, 3001};  // 9003 elements: two full runs and a remainder
  {  // swiglu forward and backward
    const Tensor g = bf(flat, 11), u = bf(flat, 12), d_o = bf(flat, 13);
    Tensor out = Tensor::empty(flat, DType::kBF16, MemCategory::kWorkspace), want = f32(out);
    cpu->swiglu_forward(g, u, out);
    cpu->swiglu_forward(f32(g), f32(u), want);
    expect_same_bits(out, rounded(want), "swiglu_forward");
    Tensor dg = Tensor::empty(flat, DType::kBF16, MemCategory::kWorkspace), du = dg.clone(MemCategory::kWorkspace);
    Tensor dg_want = f32(dg), du_want = f32(du);
    cpu->swiglu_backward(g, u, d_o, dg, du);
    cpu->swiglu_backward(f32(g), f32(u), f32(d_o), dg_want, du_want);
    expect_same_bits(dg, rounded(dg_want), "swiglu_backward d_gate");
    expect_same_bits(du, rounded(du_want), "swiglu_backward d_up");
  }
  {  // add_inplace: bf16 into bf16, bf16 into f32, f32 into bf16
    const Tensor x = bf(flat, 14);
    Tensor y = bf(flat, 15), want = f32(y);
    cpu->add_inplace(x, y);
    cpu->add_inplace(f32(x), want);
    expect_same_bits(y, rounded(want), "add_inplace bf16 into bf16");
    Tensor yf = random_tensor(flat, DType::kF32, 16), yf_want = yf.clone(MemCategory::kWorkspace);
    cpu->add_inplace(x, yf);
    cpu->add_inplace(f32(x), yf_want);
    expect_same_bits(yf, yf_want, "add_inplace bf16 into f32");
    Tensor yb = bf(flat, 17), yb_want = f32(yb);
    cpu->add_inplace(yf, yb);
    cpu->add_inplace(yf, yb_want);
    expect_same_bits(yb, rounded(yb_want), "add_inplace f32 into bf16");
  }
  {  // rmsnorm forward and backward: bf16 x, dy, y, dx; w bf16 or f32; rstd f32; dw accumulated
    const int64_t rows = 37, h = 96;
    const Tensor x = bf({rows, h}, 18), dy = bf({rows, h}, 19);
    for (DType wt : {DType::kBF16, DType::kF32}) {
      const Tensor w = wt == DType::kBF16 ? bf({h}, 20) : random_tensor({h}, DType::kF32, 20);
      Tensor y = Tensor::empty({rows, h}, DType::kBF16, MemCategory::kWorkspace), y_want = f32(y);
      Tensor rstd = Tensor::empty({rows}, DType::kF32, MemCategory::kWorkspace);
      Tensor rstd_want = rstd.clone(MemCategory::kWorkspace);
      cpu->rmsnorm_forward(x, w, 1e-5, y, rstd);
      cpu->rmsnorm_forward(f32(x), f32(w), 1e-5, y_want, rstd_want);
      expect_same_bits(y, rounded(y_want), "rmsnorm_forward y");
      expect_same_bits(rstd, rstd_want, "rmsnorm_forward rstd");
      Tensor dx = Tensor::empty({rows, h}, DType::kBF16, MemCategory::kWorkspace), dx_want = f32(dx);
      Tensor dw = wt == DType::kBF16 ? bf({h}, 21) : random_tensor({h}, DType::kF32, 21);
      Tensor dw_want = f32(dw);
      cpu->rmsnorm_backward(x, w, rstd, dy, dx, dw);
      cpu->rmsnorm_backward(f32(x), f32(w), rstd, f32(dy), dx_want, dw_want);
      expect_same_bits(dx, rounded(dx_want), "rmsnorm_backward dx");
      expect_same_bits(dw, wt == DType::kBF16 ? rounded(dw_want) : dw_want, "rmsnorm_backward dw");
    }
  }
  {  // rope forward and backward, in place
    const int64_t B = 2, S = 5, n = 3, d = 8;
    const Tensor table = random_tensor({S, 2, d / 2}, DType::kF32, 22);
    for (bool forward : {true, false}) {
      Tensor x = bf({B, S, n, d}, 23), want = f32(x);
      if (forward) {
        cpu->rope_forward(table, x);
        cpu->rope_forward(table, want);
      } else {
        cpu->rope_backward(table, x);
        cpu->rope_backward(table, want);
      }
      expect_same_bits(x, rounded(want), forward ? "rope_forward" : "rope_backward");
    }
  }
}

// Where the CPU backend takes them, the decorator hands bf16 token-wise ops over as they are:
// no widened copy is allocated.
TEST(Bf16Tokenwise, TheDecoratorPassesThemWithoutCopies) {
  auto cpu = make_cpu_backend();
  if (!cpu->tokenwise_takes_bf16()) GTEST_SKIP() << "this CPU has no bf16 matmul, so bf16 layouts widen everything";
  auto dec = make_bf16_storage_backend(*cpu);
  ASSERT_TRUE(dec->tokenwise_takes_bf16());
  const Tensor g = bf({64, 64}, 31), u = bf({64, 64}, 32), x = bf({64, 64}, 33), w = bf({64}, 34);
  Tensor out = Tensor::empty({64, 64}, DType::kBF16, MemCategory::kWorkspace), y = out.clone(MemCategory::kWorkspace);
  Tensor rstd = Tensor::empty({64}, DType::kF32, MemCategory::kWorkspace);
  MemoryTracker& mt = MemoryTracker::process();
  const int64_t before = mt.stats().total_allocations;
  dec->swiglu_forward(g, u, out);
  dec->add_inplace(x, out);
  dec->rmsnorm_forward(x, w, 1e-5, y, rstd);
  EXPECT_EQ(mt.stats().total_allocations, before) << "the decorator widened a token-wise op's operands";
}

LlamaConfig config() {
  LlamaConfig c;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.intermediate_size = 96;
  c.vocab_size = 64;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 512;
  return c;
}

struct ModelRun {
  StepResult r;
  LlamaWeights g;
  int64_t activation_peak = 0;
};

ModelRun run(const LlamaConfig& c, DType weights_dtype, Backend& be, const Batch& batch) {
  LlamaWeights w = LlamaWeights::allocate(c, weights_dtype, MemCategory::kParameters);
  init_weights(InitOptions{.seed = 4, .std = 0.1, .norm_jitter = 0.2}, w);
  ModelRun out{{}, LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients)};
  out.g.zero();
  MemoryTracker& mt = MemoryTracker::process();
  const int64_t base = mt.stats().current_of(MemCategory::kActivations);
  mt.reset_peaks();
  Result<StepResult> r = model_forward_backward(c, be, w, batch, {}, out.g);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  out.r = std::move(r).value();
  out.activation_peak = mt.stats().peak_of(MemCategory::kActivations) - base;
  return out;
}

// The model in bf16 storage against f32. Also with every attention variant (qwen3 with
// attention_bias: q/k/v/o biases and q/k norms, stored bf16 like the weights).
class Bf16Model : public ::testing::TestWithParam<bool> {};

TEST_P(Bf16Model, StaysWithinBf16PrecisionOfF32) {
  LlamaConfig c = config();
  c.qkv_bias = c.o_bias = c.qk_norm = GetParam();
  Batch batch;
  batch.input_ids = Tensor::empty({2, 128}, DType::kI32, MemCategory::kActivations);
  batch.target_ids = Tensor::empty({2, 128}, DType::kI32, MemCategory::kActivations);
  for (int64_t i = 0; i < 256; ++i) {
    batch.input_ids.data<int32_t>()[i] = static_cast<int32_t>((i * 37) % 64);
    batch.target_ids.data<int32_t>()[i] = static_cast<int32_t>((i * 11 + 5) % 64);
  }
  auto cpu = make_cpu_backend();
  auto bf = make_bf16_storage_backend(*cpu);
  const ModelRun f32 = run(c, DType::kF32, *cpu, batch);
  const ModelRun b16 = run(c, DType::kBF16, *bf, batch);
  // bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3); through two blocks and a
  // softmax the loss moves by a few of those, the gradients by a few percent. A wrong
  // conversion (or f32 statistics rounded to bf16) shows errors of order 1e-1 and more.
  EXPECT_NEAR(b16.r.loss, f32.r.loss, 1e-2 * f32.r.loss);
  std::vector<Tensor> want;
  f32.g.for_each([&](const std::string&, const Tensor& t) { want.push_back(t); });
  size_t i = 0;
  b16.g.for_each([&](const std::string& name, const Tensor& t) {
    EXPECT_TRUE(near_rel(t, want[i++], 6e-2)) << name;
  });
  // Stored activations (bf16) take about half the f32 bytes; the f32 statistics are small.
  EXPECT_LT(b16.activation_peak * 10, f32.activation_peak * 6)
      << "bf16 " << b16.activation_peak << " B vs f32 " << f32.activation_peak << " B";
}

INSTANTIATE_TEST_SUITE_P(Bf16Storage, Bf16Model, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "AttentionVariants" : "Plain"; });

}  // namespace
}  // namespace foldpar
