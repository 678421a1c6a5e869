// A whole training step (forward, backward, AdamW) of the single-rank model on the GPU,
// against the same step on the fast CPU backend: the model code is the same, only the
// backend differs (tensors live in unified memory). configs/tiny.json at S = 64, f32.
// Skipped where no GPU is visible.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "app/synthetic.h"
#include "gpu_test_util.h"
#include "model/llama_model.h"
#include "test_util.h"

namespace foldpar {
namespace {

using gpu_test::kCudaF32Model;

struct StepOutcome {
  double loss = 0;
  LlamaWeights grads;
  LlamaWeights updated;
};

StepOutcome run_step(const LlamaConfig& c, Backend& be) {
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights({.seed = 3, .std = 0.1}, w);
  const Batch batch = synthetic_batch(c, 2, 64, 5);
  LlamaWeights g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  g.zero();
  Result<StepResult> r = model_forward_backward(c, be, w, batch, StepOptions{}, g);
  FP_CHECK_OK(r.status());
  // One AdamW step on every parameter, through the backend.
  std::vector<Tensor> grads;
  g.for_each([&](const std::string&, Tensor& t) { grads.push_back(t); });
  size_t i = 0;
  Backend::AdamWStep s;
  s.lr = 1e-3;
  s.weight_decay = 0.1;
  // A large eps keeps the update smooth in g (|d update / d g| <= 1/eps): with the default
  // 1e-8, a gradient element near 1e-9 turns a 1e-5 relative gradient error into a flipped
  // step. The formula itself is checked by cuda_ops_test.
  s.eps = 1e-3;
  w.for_each([&](const std::string&, Tensor& p) {
    Tensor m = Tensor::zeros(p.shape(), DType::kF32, MemCategory::kOptimizer);
    Tensor v = Tensor::zeros(p.shape(), DType::kF32, MemCategory::kOptimizer);
    be.adamw_update(s, grads[i++], p, m, v);
  });
  return {r->loss, std::move(g), std::move(w)};
}

TEST(CudaModel, TrainingStepMatchesTheCpuBackend) {
  FP_REQUIRE_GPU();
  Result<LlamaConfig> c = LlamaConfig::load(std::string(FOLDPAR_SOURCE_DIR) + "/configs/tiny.json");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto cpu = make_cpu_backend();
  auto cuda = make_cuda_backend(gpu_test::synced_options());
  StepOutcome want = run_step(*c, *cpu);
  StepOutcome got = run_step(*c, *cuda);
  EXPECT_NEAR(got.loss, want.loss, kCudaF32Model * want.loss);
  std::vector<std::pair<std::string, Tensor>> ref;
  want.grads.for_each([&](const std::string& n, Tensor& t) { ref.emplace_back(n, t); });
  size_t i = 0;
  got.grads.for_each([&](const std::string& name, Tensor& t) {
    EXPECT_TRUE(testing::near_rel(t, ref[i++].second, kCudaF32Model)) << "gradient " << name;
  });
  std::vector<Tensor> ref_w;
  want.updated.for_each([&](const std::string&, Tensor& t) { ref_w.push_back(t); });
  i = 0;
  got.updated.for_each([&](const std::string& name, Tensor& t) {
    EXPECT_TRUE(testing::near_rel(t, ref_w[i++], kCudaF32Model)) << "updated " << name;
  });
}

}  // namespace
}  // namespace foldpar
