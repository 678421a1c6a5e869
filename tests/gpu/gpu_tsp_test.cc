// TSP on the GPU against the single-rank model on the CPU: every rank builds the global
// weights and batch from one seed, computes the single-rank loss and gradients on the fast
// CPU backend, then runs the TSP step with the CUDA backend over a device communicator and
// compares the loss and the assembled gradients. Run under mpirun at 1 and 2 ranks on one
// GPU (D = the world size; ranks sharing the GPU get the host-staged communicator).
// Skipped where no GPU is visible.
#include <gtest/gtest.h>

#include "app/synthetic.h"
#include "comm/nccl/device_communicator.h"
#include "gpu_test_util.h"
#include "mpi_test_main.h"
#include "parallel/tsp/tsp_model.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

using gpu_test::kCudaF32Model;

LlamaConfig test_config() {
  LlamaConfig c;
  c.hidden_size = 128;  // d = 16
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.intermediate_size = 160;
  c.vocab_size = 128;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 1024;
  c.rms_norm_eps = 1e-5;
  return c;
}

TEST(GpuTsp, TrainingStepMatchesTheSingleRankModel) {
  FP_REQUIRE_GPU();
  Communicator& world = test::mpi().world();
  const int D = world.size(), p = world.rank();
  const LlamaConfig c = test_config();
  const int64_t seq = 64;
  const InitOptions init{.seed = 7, .std = 0.1, .norm_jitter = 0.2};

  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(init, w);
  const Batch global = synthetic_batch(c, 1, seq, 11, 0.1);
  auto cpu = make_cpu_backend();
  LlamaWeights ref_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  Result<StepResult> ref = model_forward_backward(c, *cpu, w, global, StepOptions{}, ref_g);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();

  auto cuda = make_cuda_backend(gpu_test::synced_options());
  std::unique_ptr<Communicator> tsp = make_device_communicator(world, {.device = 0, .compute_stream = cuda->stream()});
  Result<TspModel> model = TspModel::create(c, tsp_layout(D), p, seq);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ShardedWeights tw = ShardedWeights::allocate(c, model->dims(), p, DType::kF32, MemCategory::kParameters);
  init_sharded_weights(init, tw);
  ShardedWeights tg = ShardedWeights::allocate(c, model->dims(), p, DType::kF32, MemCategory::kGradients);
  tg.zero();
  const Batch local = model->shard().local_batch(global);
  Result<StepResult> got = model->forward_backward(*cuda, *tsp, tw, local, tg);
  ASSERT_TRUE(got.ok()) << got.status().to_string();

  EXPECT_EQ(got->valid_tokens, ref->valid_tokens);
  EXPECT_NEAR(got->loss, ref->loss, kCudaF32Model * ref->loss);
  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(assemble_global(tg, world, assembled).ok());
  std::vector<Tensor> ref_list;
  ref_g.for_each([&](const std::string&, Tensor& t) { ref_list.push_back(t); });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    const Tensor& want = ref_list[i++];
    EXPECT_LE(max_rel_error(t, want), kCudaF32Model) << name << " on rank " << p << "\n"
                                                     << describe_mismatches(t, want, kCudaF32Model);
  });
}

}  // namespace
}  // namespace foldpar
