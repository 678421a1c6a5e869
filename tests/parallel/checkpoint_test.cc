// Checkpoints reshard: written by tsp=N (every rank its own shards and AdamW moments),
// read back by one rank, by tsp=2 on a split communicator and by tsp=N; a failed write on
// one rank leaves the previous checkpoint as the newest complete one, and so does a failure
// from the injected CheckpointHooks, which run on every rank after its own file is written.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <tuple>

#include "checkpoint/checkpoint.h"
#include "comm/mesh.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"
#include "parallel/sharded_weights.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

namespace fs = std::filesystem;

LlamaConfig config() {
  LlamaConfig c;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.intermediate_size = 48;
  c.vocab_size = 16;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 64;
  return c;
}

// Moments with values of their own: m = 2 p + 1, v = p^2 (computed from the weights).
void fill_moments(const std::vector<ParamRef>& refs, std::vector<Tensor>& m, std::vector<Tensor>& v) {
  for (const ParamRef& p : refs) {
    Tensor a = Tensor::empty(p.param.shape(), DType::kF32, MemCategory::kOptimizer);
    Tensor b = Tensor::empty(p.param.shape(), DType::kF32, MemCategory::kOptimizer);
    for (int64_t i = 0; i < p.param.numel(); ++i) {
      a.data<float>()[i] = 2 * p.param.data<float>()[i] + 1;
      b.data<float>()[i] = p.param.data<float>()[i] * p.param.data<float>()[i];
    }
    m.push_back(a);
    v.push_back(b);
  }
}

std::string root_dir(Communicator& world) {
  // Every rank agrees on rank 0's pid.
  int64_t pid = ::getpid();
  FP_CHECK_OK(world.broadcast(&pid, 1, DType::kI64, 0));
  return (fs::temp_directory_path() / ("foldpar_ckpt_test_" + std::to_string(pid))).string();
}

class Checkpoint : public ::testing::Test {
 protected:
  void TearDown() override {
    FP_CHECK_OK(test::mpi().world().barrier());
    if (test::mpi().world().rank() == 0) fs::remove_all(root_);
  }
  std::string root_ = root_dir(test::mpi().world());
};

// A Mixtral-shaped config with E experts of width 24 in both layers.
LlamaConfig moe_config(int64_t experts) {
  LlamaConfig c = config();
  c.moe.family = MoeFamily::kMixtral;
  c.moe.num_experts = experts;
  c.moe.num_experts_per_tok = 1;
  c.moe.moe_intermediate_size = 24;
  c.moe.norm_topk_prob = true;
  return c;
}

// kv_heads: num_key_value_heads (1: KV replicas at N > 1, written once per KV head from
// each group's first rank, loaded into every replica). A MoE config's experts are written
// whole or, where N > E, as the f_e slices of each expert's N/E ranks.
// writer: the layout that writes (make_sharded_model's parameters, as train saves them);
// null: tsp=N by hand.
void expect_written_under_tsp_loads_under_any_layout(const std::string& root_, int64_t kv_heads,
                                                     LlamaConfig c = config(), const char* writer = nullptr) {
  Communicator& world = test::mpi().world();
  const int N = world.size(), p = world.rank();
  c.num_key_value_heads = kv_heads;
  const InitOptions init{.seed = 9, .std = 0.5, .norm_jitter = 0.5};
  const ShardDims dims = shard_dims(c, N);
  ShardedWeights w = ShardedWeights::allocate(c, dims, p, DType::kF32, MemCategory::kParameters);
  ShardedWeights g = ShardedWeights::allocate(c, dims, p, DType::kF32, MemCategory::kGradients);
  init_sharded_weights(init, w);
  std::vector<ParamRef> refs = sharded_param_refs(w, g, p == 0);
  std::unique_ptr<Mesh> mesh;
  std::unique_ptr<ShardedModel> model;
  if (writer != nullptr) {
    const Layout lo = parse_layout(writer).value();
    Result<Mesh> made_mesh = Mesh::create(world, lo.mesh());
    ASSERT_TRUE(made_mesh.ok()) << made_mesh.status().to_string();
    mesh = std::make_unique<Mesh>(std::move(*made_mesh));
    Result<std::unique_ptr<ShardedModel>> made = make_sharded_model(c, *mesh, 16, lo);
    ASSERT_TRUE(made.ok()) << made.status().to_string();
    model = std::move(*made);
    model->init_weights(init);
    refs = model->parameters();
  }
  std::vector<Tensor> m, v;
  fill_moments(refs, m, v);
  CheckpointState st{7, 123, 9, "tsp", c};
  Result<std::string> dir = save_checkpoint(root_, st, CheckpointWrite{&refs, &m, &v, true, 2}, world);
  ASSERT_TRUE(dir.ok()) << dir.status().to_string();
  Result<std::string> latest = latest_checkpoint(root_);
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(*latest, *dir);
  Result<CheckpointState> back = read_checkpoint_state(*dir);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->step, 7);
  EXPECT_EQ(back->next_batch, 123u);

  // (a) one rank: the full model, equal to the single-rank initialization.
  LlamaWeights full = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  LlamaWeights full_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  full.zero();
  std::vector<ParamRef> full_refs = replicated_param_refs(full, full_g, true);
  std::vector<Tensor> fm, fv;
  fill_moments(full_refs, fm, fv);  // overwritten by the load
  ASSERT_TRUE(load_checkpoint(*dir, c, full_refs, &fm, &fv).ok());
  LlamaWeights want = LlamaWeights::allocate(c, DType::kF32, MemCategory::kWorkspace);
  init_weights(init, want);
  std::vector<Tensor> want_list;
  want.for_each([&](const std::string&, Tensor& t) { want_list.push_back(t); });
  for (size_t i = 0; i < full_refs.size(); ++i) {
    EXPECT_EQ(max_rel_error(full_refs[i].param, want_list[i]), 0.0) << full_refs[i].name;
    for (int64_t j = 0; j < want_list[i].numel(); ++j) {
      const float x = want_list[i].data<float>()[j];
      ASSERT_EQ(fm[i].data<float>()[j], 2 * x + 1) << full_refs[i].name << " adam_m[" << j << "]";
      ASSERT_EQ(fv[i].data<float>()[j], x * x) << full_refs[i].name << " adam_v[" << j << "]";
    }
  }

  // (b) tsp=2 on halves of the world (when N is even): each rank's new shards equal the
  // slices of the global weights.
  if (N % 2 == 0 && c.num_attention_heads % 2 == 0) {
    std::unique_ptr<Communicator> half = world.split(p / 2, p, "half");
    const ShardDims d2 = shard_dims(c, 2);
    ShardedWeights w2 = ShardedWeights::allocate(c, d2, half->rank(), DType::kF32, MemCategory::kParameters);
    ShardedWeights g2 = ShardedWeights::allocate(c, d2, half->rank(), DType::kF32, MemCategory::kGradients);
    std::vector<ParamRef> refs2 = sharded_param_refs(w2, g2, half->rank() == 0);
    ASSERT_TRUE(load_checkpoint(*dir, c, refs2, nullptr, nullptr).ok());
    ShardedWeights expect2 = ShardedWeights::allocate(c, d2, half->rank(), DType::kF32, MemCategory::kWorkspace);
    init_sharded_weights(init, expect2);
    std::vector<Tensor> e;
    expect2.for_each([&](const std::string&, Tensor& t, bool) { e.push_back(t); });
    size_t i = 0;
    w2.for_each([&](const std::string& name, Tensor& t, bool) { EXPECT_EQ(max_rel_error(t, e[i++]), 0.0) << name; });
  }
  // A different model is refused with the reason.
  LlamaConfig other = c;
  other.num_hidden_layers = 3;
  EXPECT_EQ(load_checkpoint(*dir, other, full_refs, nullptr, nullptr).code(), StatusCode::kInvalidArgument);
}

TEST_F(Checkpoint, WrittenUnderTspLoadsUnderAnyLayout) { expect_written_under_tsp_loads_under_any_layout(root_, 4); }

TEST_F(Checkpoint, WrittenWithKvReplicasLoadsUnderAnyLayout) {
  expect_written_under_tsp_loads_under_any_layout(root_, 1);
}

// Mixture of experts: E = 2 written by N = 4 ranks (two per expert, each an f_e slice) loads
// on one rank and on tsp=2 (one whole expert per rank); E = 1 written by N = 2 or 4 loads on
// one rank and on tsp=2 (the one expert split in two).
TEST_F(Checkpoint, MoeWithExpertsSplitOverRanksLoadsUnderAnyLayout) {
  expect_written_under_tsp_loads_under_any_layout(root_ + "/e2", 4, moe_config(2));
  expect_written_under_tsp_loads_under_any_layout(root_ + "/e1", 4, moe_config(1));
}

// Expert parallelism on the Megatron baselines: written by tp=2 / sp=2 (two ranks: two of
// the four experts each) and tp=2,sp=2 / tp=2,sp=2:seqpar (four ranks: one expert each, the
// tp slices of attention written by sp rank 0 only, the experts by every rank), loaded on one
// rank and on tsp=2 (parallel/megatron/tp_moe.cc).
TEST_F(Checkpoint, MoeWrittenUnderExpertParallelMegatronLayoutsLoadsUnderAnyLayout) {
  const int N = test::mpi().world().size();
  if (N == 1) GTEST_SKIP() << "expert parallelism needs two ranks";
  const std::vector<const char*> writers =
      N == 2 ? std::vector<const char*>{"tp=2", "sp=2"} : std::vector<const char*>{"tp=2,sp=2", "tp=2,sp=2:seqpar"};
  int i = 0;
  for (const char* writer : writers) {
    SCOPED_TRACE(writer);
    expect_written_under_tsp_loads_under_any_layout(root_ + "/ep" + std::to_string(i++), 4, moe_config(4), writer);
  }
  if (N == 4) expect_written_under_tsp_loads_under_any_layout(root_ + "/ep2", 4, moe_config(2), "tp=2,sp=2");
}

TEST_F(Checkpoint, AFailedWriteKeepsThePreviousCheckpoint) {
  Communicator& world = test::mpi().world();
  const int N = world.size(), p = world.rank();
  const LlamaConfig c = config();
  const ShardDims dims = shard_dims(c, N);
  ShardedWeights w = ShardedWeights::allocate(c, dims, p, DType::kF32, MemCategory::kParameters);
  ShardedWeights g = ShardedWeights::allocate(c, dims, p, DType::kF32, MemCategory::kGradients);
  init_sharded_weights(InitOptions{.seed = 1}, w);
  std::vector<ParamRef> refs = sharded_param_refs(w, g, p == 0);
  ASSERT_TRUE(save_checkpoint(root_, CheckpointState{1, 10, 1, "tsp", c}, CheckpointWrite{&refs}, world).ok());
  // The last rank's file cannot be written: a file-size limit as a full disk would (EFBIG;
  // root ignores permission bits, so a read-only directory would not fail here).
  struct rlimit old {};
  const bool victim = p == N - 1;
  if (victim) {
    std::signal(SIGXFSZ, SIG_IGN);
    getrlimit(RLIMIT_FSIZE, &old);
    struct rlimit tiny = old;
    tiny.rlim_cur = 512;
    setrlimit(RLIMIT_FSIZE, &tiny);
  }
  Result<std::string> second = save_checkpoint(root_, CheckpointState{2, 20, 1, "tsp", c}, CheckpointWrite{&refs}, world);
  if (victim) setrlimit(RLIMIT_FSIZE, &old);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find(victim ? "write" : std::to_string(N - 1)), std::string::npos)
      << second.status().message();
  FP_CHECK_OK(world.barrier());
  Result<std::string> latest = latest_checkpoint(root_);
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(read_checkpoint_state(*latest)->step, 1);
  EXPECT_FALSE(fs::exists(fs::path(root_) / ".incomplete-step-00000002"));
  // And a third save succeeds and keeps two.
  ASSERT_TRUE(save_checkpoint(root_, CheckpointState{3, 30, 1, "tsp", c}, CheckpointWrite{&refs}, world).ok());
  EXPECT_EQ(read_checkpoint_state(*latest_checkpoint(root_))->step, 3);
}

TEST_F(Checkpoint, AHookRunsOnEveryRankAndItsFailureFailsTheSave) {
  Communicator& world = test::mpi().world();
  const int N = world.size(), p = world.rank();
  const LlamaConfig c = config();
  const ShardDims dims = shard_dims(c, N);
  ShardedWeights w = ShardedWeights::allocate(c, dims, p, DType::kF32, MemCategory::kParameters);
  ShardedWeights g = ShardedWeights::allocate(c, dims, p, DType::kF32, MemCategory::kGradients);
  init_sharded_weights(InitOptions{.seed = 1}, w);
  std::vector<ParamRef> refs = sharded_param_refs(w, g, p == 0);
  // Every rank's hook sees the step being written, its rank and the world size, after its own
  // file is in the incomplete directory.
  std::vector<std::tuple<int64_t, int, int>> calls;
  bool file_was_there = false;
  CheckpointWrite write{&refs};
  write.hooks.after_rank_file = [&](int64_t step, int rank, int size) {
    calls.emplace_back(step, rank, size);
    file_was_there = fs::exists(fs::path(root_) / fmt::format(".incomplete-step-{:08d}", step) /
                                fmt::format("rank-{:05d}.safetensors", rank));
    if (step == 2 && rank == size - 1) return io_error("injected failure on rank {}", rank);
    return Status();
  };
  ASSERT_TRUE(save_checkpoint(root_, CheckpointState{1, 10, 1, "tsp", c}, write, world).ok());
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0], std::make_tuple(int64_t{1}, p, N));
  EXPECT_TRUE(file_was_there);
  Result<std::string> second = save_checkpoint(root_, CheckpointState{2, 20, 1, "tsp", c}, write, world);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(calls.size(), 2u);
  EXPECT_NE(second.status().message().find(p == N - 1 ? "injected failure" : std::to_string(N - 1)), std::string::npos)
      << second.status().message();
  FP_CHECK_OK(world.barrier());
  EXPECT_EQ(read_checkpoint_state(*latest_checkpoint(root_))->step, 1);
  EXPECT_FALSE(fs::exists(fs::path(root_) / ".incomplete-step-00000002"));
  // With no hooks (production), nothing runs and the save succeeds.
  ASSERT_TRUE(save_checkpoint(root_, CheckpointState{3, 30, 1, "tsp", c}, CheckpointWrite{&refs}, world).ok());
  EXPECT_EQ(calls.size(), 2u);
}

}  // namespace
}  // namespace foldpar
