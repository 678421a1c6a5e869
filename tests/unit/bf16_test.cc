// bf16 storage: the decorator passes f32 through untouched and computes bf16 operands in
// f32; a whole model stored in bf16 (weights and activations, f32 gradients and per-row
// statistics) stays within bf16's precision of the f32 model and halves the activations.
#include <gtest/gtest.h>

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
