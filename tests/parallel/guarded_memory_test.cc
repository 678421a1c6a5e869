// The device-memory stand-in (issue 20; tensor/guarded_allocator.h): every tensor comes from
// the process tracker backed by guarded memory, PROT_NONE outside Backend ops and communicator calls,
// the backend is the fast CPU one behind the guarded decorator (backend/guarded_backend.h)
// and every mesh axis a guarded communicator (comm/guarded_communicator.h). Under it run the
// trainer's steps of every layout of this many ranks (with a checkpoint written at the end
// and a resumed run that loads it), and generation (prefill and decode) of the decoding
// layouts. Any host touch of tensor data kills the process with a SIGSEGV naming the address
// (the fault handler), which fails the ctest entry; each run's results must also equal the
// same run without the guard, so the guard changes nothing but access.
// The negative control (a deliberate host read is caught) is tests/unit/guarded_allocator_test.cc.
#include <gtest/gtest.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>

#include <filesystem>
#include <functional>
#include <fstream>

#include "app/generate.h"
#include "app/step_bench.h"
#include "backend/bf16_storage_backend.h"
#include "backend/guarded_backend.h"
#include "checkpoint/hf_directory.h"
#include "comm/guarded_communicator.h"
#include "data/corpus.h"
#include "infer/generator.h"
#include "data/tokenizer.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"
#include "tensor/storageless_allocator.h"
#include "train/trainer.h"

namespace foldpar {
namespace {

namespace fs = std::filesystem;

LlamaConfig small_config() {
  LlamaConfig c;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.intermediate_size = 96;
  c.vocab_size = 256;  // byte tokens
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 256;
  return c;
}

// FOLDPAR_GUARD_SURVEY=1: instead of dying at the first host touch, print each one's
// backtrace and open the memory until the next op closes it, so that one run lists them all
// (a diagnostic for finding host touches; the test fails all the same).
GuardedAllocator* g_survey_guard = nullptr;
std::atomic<int> g_survey_faults{0};
void on_survey_fault(int, siginfo_t* info, void*) {
  GuardedAllocator* g = g_survey_guard;
  if (g == nullptr || !g->contains(info->si_addr)) {
    signal(SIGSEGV, SIG_DFL);
    return;
  }
  ++g_survey_faults;
  const char msg[] = "foldpar: host access inside guarded tensor memory; backtrace:\n";
  (void)!write(STDERR_FILENO, msg, sizeof msg - 1);
  void* frames[32];
  backtrace_symbols_fd(frames, backtrace(frames, 32), STDERR_FILENO);
  (void)!write(STDERR_FILENO, "*** end\n", 8);
  mprotect(g->base(), g->reserved_bytes(), PROT_READ | PROT_WRITE);
}

// MemoryTracker::process() backed by the guard, as `--device cuda` backs it by device
// memory (tools/cuda_device.cc): so code that allocates on process() by name, not only
// through the default tracker, gets guarded memory too (checkpoint staging once did, and
// faulted on the GPU). The guarded backend and communicators.
struct GuardedRun {
  GuardedAllocator guard;
  std::unique_ptr<Backend> cpu, bf16, backend;

  // bf16: the CPU backend under bf16 storage, as the trainer makes it for a bf16 layout.
  explicit GuardedRun(bool bf16_storage = false) {
    if (getenv("FOLDPAR_GUARD_SURVEY") != nullptr) {
      g_survey_guard = &guard;
      struct sigaction sa{};
      sa.sa_sigaction = on_survey_fault;
      sa.sa_flags = SA_SIGINFO;
      sigaction(SIGSEGV, &sa, nullptr);
    }
    g_survey_faults = 0;
    install_storageless_fault_handler();
    MemoryTracker::process().set_block_allocator(&guard);
    cpu = make_cpu_backend();
    if (bf16_storage) bf16 = make_bf16_storage_backend(*cpu);
    backend = make_guarded_backend(bf16 ? *bf16 : *cpu, guard);
  }
  ~GuardedRun() {
    // Every tensor of the run is gone (the members' destructors below free none).
    MemoryTracker::process().set_block_allocator(nullptr);
    EXPECT_EQ(g_survey_faults.load(), 0) << "host touches of guarded memory (FOLDPAR_GUARD_SURVEY)";
    g_survey_guard = nullptr;
  }
  AxisCommFactory axis_comm() {
    return [this](Communicator& host) { return make_guarded_communicator(host, nullptr, guard); };
  }
};

// A directory every rank names alike (rank 0's pid), removed by rank 0 at the end.
struct SharedDir {
  fs::path path;
  explicit SharedDir(const std::string& what) {
    Communicator& world = test::mpi().world();
    int32_t pid = static_cast<int32_t>(getpid());
    FP_CHECK_OK(world.broadcast(&pid, 1, DType::kI32, 0));
    path = fs::temp_directory_path() / ("foldpar_guarded_" + std::to_string(pid) + "_" + what);
    if (world.rank() == 0) fs::create_directories(path);
    FP_CHECK_OK(world.barrier());
  }
  ~SharedDir() {
    (void)test::mpi().world().barrier();
    if (test::mpi().world().rank() == 0) fs::remove_all(path);
  }
};

// A byte-token corpus of a few hundred documents (each rank writes its own copy alike).
std::string make_corpus(const fs::path& dir) {
  const fs::path text = dir / ("text_" + std::to_string(test::mpi().world().rank()));
  {
    std::ofstream f(text);
    for (int i = 0; i < 300; ++i) f << "fortune " << i << ": the guard lets only Backend ops touch data\n%\n";
  }
  PrepareOptions o;
  o.inputs = {text.string()};
  o.out_dir = (dir / ("corpus_" + std::to_string(test::mpi().world().rank()))).string();
  o.tokenizer = "bytes";
  FP_CHECK_OK(prepare_corpus(o).status());
  return o.out_dir;
}

TrainOptions train_options(const std::string& layout, const std::string& data, const fs::path& out) {
  TrainOptions o;
  o.config = small_config();
  o.layout = parse_layout(layout).value();
  if (o.layout->pp > 1) o.micro_batch = 1;  // micro-batches to fill the stages
  o.data_dir = data;
  o.seq = 64;
  o.batch = 4;
  o.steps = 3;
  o.eval_every = 0;
  o.eval_batches = 1;
  o.print_every = 0;
  o.seed = 5;
  o.out_dir = out.string();
  return o;
}

// Three steps of `layout` without the guard; under it two steps (a checkpoint at the end),
// then a run resumed from that checkpoint to step three: the same losses. options(out) makes
// each run's options (the layout's, its data, the output directory).
void expect_guarded_training_matches(const std::string& layout, const std::string& what,
                                     const std::function<TrainOptions(const fs::path&)>& options) {
  Communicator& world = test::mpi().world();
  SharedDir dir(what + "_" + std::to_string(world.size()));
  Result<TrainReport> plain = run_training(options(dir.path / "plain"), world);
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  std::vector<double> losses;
  {
    GuardedRun g(parse_layout(layout).value().dtype == DType::kBF16);
    TrainOptions o = options(dir.path / "guarded");
    o.backend = g.backend.get();
    o.axis_comm = g.axis_comm();
    o.steps = 2;
    Result<TrainReport> first = run_training(o, world);
    ASSERT_TRUE(first.ok()) << first.status().to_string();
    o.steps = 3;
    o.resume = true;
    Result<TrainReport> resumed = run_training(o, world);
    ASSERT_TRUE(resumed.ok()) << resumed.status().to_string();
    EXPECT_EQ(resumed->steps_done, 1);
    losses = first->losses;
    losses.insert(losses.end(), resumed->losses.begin(), resumed->losses.end());
    EXPECT_GT(g.guard.windows_opened(), 100) << "the guard was never opened: nothing ran under it";
    EXPECT_FALSE(g.guard.is_open());
  }
  ASSERT_EQ(losses.size(), plain->losses.size());
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_NEAR(losses[i], plain->losses[i], 1e-9 * std::abs(plain->losses[i]))
        << layout << " step " << i + 1 << " rank " << world.rank();
  }
}

class GuardedTraining : public testing::TestWithParam<const char*> {};

TEST_P(GuardedTraining, StepsCheckpointAndResumeTouchNoTensorOnTheHost) {
  const Layout lo = parse_layout(GetParam()).value();
  if (lo.ranks() != test::mpi().world().size()) GTEST_SKIP() << GetParam() << " runs at " << lo.ranks() << " ranks";
  SharedDir data_dir("train_data_" + std::to_string(test::mpi().world().size()));
  const std::string data = make_corpus(data_dir.path);
  expect_guarded_training_matches(GetParam(), "train",
                                  [&](const fs::path& out) { return train_options(GetParam(), data, out); });
}

INSTANTIATE_TEST_SUITE_P(Layouts, GuardedTraining,
                         testing::Values("tsp=1", "tsp=2", "tsp=2:nooverlap", "tp=2", "tp=2:seqpar", "sp=2",
                                         "sp=2:ring", "dp=2,tsp=1", "tp=2,sp=2", "dp=2,tsp=2", "dp=2,tp=2",
                                         // bf16 weights: the f32 masters are made from them
                                         "tsp=1:bf16", "tsp=2:bf16", "tp=2:bf16",
                                         // pipeline stages
                                         "pp=2,tsp=1", "dp=2,pp=2,tsp=1"),
                         [](const testing::TestParamInfo<const char*>& i) {
                           std::string n = i.param;
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// A mixture-of-experts model (E = 4, k = 2, the load-balancing loss on) on each dispatch
// scheme, tp and tp x sp, experts over dp replicas, bf16 and a pipeline: routing, the
// token-expert pairs' exchange and the aux loss must go through the backend and the mesh's
// communicators too.
class GuardedMoeTraining : public testing::TestWithParam<const char*> {};

TEST_P(GuardedMoeTraining, StepsCheckpointAndResumeTouchNoTensorOnTheHost) {
  const Layout lo = parse_layout(GetParam()).value();
  if (lo.ranks() != test::mpi().world().size()) GTEST_SKIP() << GetParam() << " runs at " << lo.ranks() << " ranks";
  SharedDir data_dir("moe_data_" + std::to_string(test::mpi().world().size()));
  const std::string data = make_corpus(data_dir.path);
  expect_guarded_training_matches(GetParam(), "moe", [&](const fs::path& out) {
    TrainOptions o = train_options(GetParam(), data, out);
    o.config.moe.num_experts = 4;
    o.config.moe.num_experts_per_tok = 2;
    o.config.moe.moe_intermediate_size = 48;
    o.config.moe.norm_topk_prob = true;
    o.config.moe.router_aux_loss_coef = 0.02;
    o.config.moe.output_router_logits = true;
    return o;
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, GuardedMoeTraining,
                         testing::Values("tsp=1", "tsp=2:moe=a2a", "tsp=2:moe=gather", "tsp=2:moe=ring", "tp=2",
                                         "dp=2,tsp=1,ep=2", "tsp=2:bf16:moe=a2a", "pp=2,tsp=1",
                                         "dp=2,tsp=2,ep=4:moe=ring", "tp=2,sp=2", "dp=2,tp=2,ep=4"),
                         [](const testing::TestParamInfo<const char*>& i) {
                           std::string n = i.param;
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// `train --init-from`: a Hugging Face directory read into the layout's slices (safetensors
// reads into host staging, then explicit copies), then steps: the same losses under the guard.
TEST(GuardedInitFrom, HuggingFaceWeightsLoadTouchesNoTensorOnTheHost) {
  Communicator& world = test::mpi().world();
  if (world.size() > 2) GTEST_SKIP() << "the test model's 2 kv heads do not split over " << world.size() << " ranks";
  const std::string layout = "tsp=" + std::to_string(world.size());
  SharedDir dir("init_from_" + std::to_string(world.size()));
  const fs::path hf = dir.path / "hf";
  if (world.rank() == 0) {
    LlamaWeights w = LlamaWeights::allocate(small_config(), DType::kF32, MemCategory::kParameters);
    init_weights(InitOptions{.seed = 11, .std = 0.05, .norm_jitter = 0.1}, w);
    FP_CHECK_OK(write_hf_directory(hf.string(), small_config(), w));
  }
  FP_CHECK_OK(world.barrier());
  const std::string data = make_corpus(dir.path);
  TrainOptions o = train_options(layout, data, dir.path / "plain");
  o.init_from = hf.string();
  o.final_checkpoint = false;
  Result<TrainReport> plain = run_training(o, world);
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  GuardedRun g;
  o.out_dir = (dir.path / "guarded").string();
  o.backend = g.backend.get();
  o.axis_comm = g.axis_comm();
  Result<TrainReport> guarded = run_training(o, world);
  ASSERT_TRUE(guarded.ok()) << guarded.status().to_string();
  EXPECT_GT(g.guard.windows_opened(), 100);
  EXPECT_EQ(guarded->losses, plain->losses);
}

// `foldpar bench`'s single-rank steps (weights, the synthetic batch, zeroed gradients), f32
// and bf16: the same loss under the guard.
class GuardedStepBench : public testing::TestWithParam<bool> {};

TEST_P(GuardedStepBench, StepsTouchNoTensorOnTheHost) {
  StepBenchOptions o;
  o.config = small_config();
  o.batch = 2;
  o.seq = 32;
  o.warmup = 1;
  o.steps = 2;
  o.bf16 = GetParam();
  Result<StepBenchReport> plain = run_step_bench(o);
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  GuardedRun g(o.bf16);
  o.backend = g.backend.get();  // a borrowed backend: no decorator of the bench's own
  Result<StepBenchReport> guarded = run_step_bench(o);
  ASSERT_TRUE(guarded.ok()) << guarded.status().to_string();
  EXPECT_GT(g.guard.windows_opened(), 50);
  EXPECT_FALSE(g.guard.is_open());
  EXPECT_EQ(guarded->loss, plain->loss);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GuardedStepBench, testing::Values(false, true),
                         [](const testing::TestParamInfo<bool>& i) { return i.param ? "bf16" : "f32"; });

// Generation's completions (prefill, then decode steps).
Result<GenerationReport> generate_with(const std::string& layout, Backend& be, const AxisCommFactory& axis_comm) {
  Communicator& world = test::mpi().world();
  const Layout lo = parse_layout(layout).value();
  FP_ASSIGN_OR_RETURN(Mesh mesh, Mesh::create(world, lo.mesh(), axis_comm));
  FP_ASSIGN_OR_RETURN(std::unique_ptr<ShardedDecoder> decoder, make_sharded_decoder(small_config(), mesh, lo));
  decoder->init_weights(InitOptions{.seed = 9, .std = 0.1});
  const std::unique_ptr<Tokenizer> bytes = make_byte_tokenizer();
  GenerationOptions o;
  o.max_new_tokens = 8;
  return generate(*decoder, be, *bytes, {"the guard", "lets only"}, o, world);
}

class GuardedGeneration : public testing::TestWithParam<const char*> {};

TEST_P(GuardedGeneration, PrefillAndDecodeTouchNoTensorOnTheHost) {
  Communicator& world = test::mpi().world();
  if (world.size() > 2) GTEST_SKIP() << "the test model's 2 kv heads do not split over " << world.size() << " ranks";
  const std::string layout = std::string(GetParam()) + "=" + std::to_string(world.size());
  auto cpu = make_cpu_backend();
  Result<GenerationReport> plain = generate_with(layout, *cpu, {});
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  GuardedRun g;
  Result<GenerationReport> guarded = generate_with(layout, *g.backend, g.axis_comm());
  ASSERT_TRUE(guarded.ok()) << guarded.status().to_string();
  EXPECT_GT(g.guard.windows_opened(), 10);
  ASSERT_EQ(guarded->completions.size(), plain->completions.size());
  for (size_t i = 0; i < plain->completions.size(); ++i) {
    EXPECT_EQ(guarded->completions[i].tokens, plain->completions[i].tokens) << layout << " prompt " << i;
  }
  EXPECT_EQ(guarded->decode_tokens, plain->decode_tokens);
}

INSTANTIATE_TEST_SUITE_P(Layouts, GuardedGeneration, testing::Values("tsp", "tp"));

// `foldpar generate --checkpoint` as the program runs it (app/generate.h): the checkpoint
// found and loaded into the decoder's slices, the byte tokenizer, prefill and decode. A
// plain training run writes the checkpoint.
class GuardedGenerateFromCheckpoint : public testing::TestWithParam<const char*> {};

TEST_P(GuardedGenerateFromCheckpoint, LoadPrefillAndDecodeTouchNoTensorOnTheHost) {
  Communicator& world = test::mpi().world();
  if (world.size() > 2) GTEST_SKIP() << "the test model's 2 kv heads do not split over " << world.size() << " ranks";
  const std::string layout = std::string(GetParam()) + "=" + std::to_string(world.size());
  SharedDir dir(std::string("generate_") + GetParam() + std::to_string(world.size()));
  const std::string data = make_corpus(dir.path);
  TrainOptions t = train_options(layout, data, dir.path / "trained");
  t.steps = 2;
  ASSERT_TRUE(run_training(t, world).ok());
  GenerateOptions o;
  o.checkpoint = (dir.path / "trained").string();
  o.layout = parse_layout(layout).value();
  o.prompts = {"the guard", "lets only"};
  o.generation.max_new_tokens = 6;
  Result<GenerateResult> plain = run_generate(o, world);
  ASSERT_TRUE(plain.ok()) << plain.status().to_string();
  GuardedRun g;
  o.backend = g.backend.get();
  o.axis_comm = g.axis_comm();
  Result<GenerateResult> guarded = run_generate(o, world);
  ASSERT_TRUE(guarded.ok()) << guarded.status().to_string();
  EXPECT_GT(g.guard.windows_opened(), 10);
  if (world.rank() == 0) {
    ASSERT_EQ(plain->report.completions.size(), 2u);
  }
  ASSERT_EQ(guarded->report.completions.size(), plain->report.completions.size());
  for (size_t i = 0; i < plain->report.completions.size(); ++i)
    EXPECT_EQ(guarded->report.completions[i].tokens, plain->report.completions[i].tokens) << layout << " prompt " << i;
}

INSTANTIATE_TEST_SUITE_P(Layouts, GuardedGenerateFromCheckpoint, testing::Values("tsp", "tp"));

// Under pp the two prompts stay in flight across steps (decode_in_flight): the logits cross
// from the last stage to rank 0's sampler, the end flag is read, through the backend only.
TEST(GuardedPipelineGeneration, InFlightDecodingTouchesNoTensorOnTheHost) {
  Communicator& world = test::mpi().world();
  if (world.size() != 2) GTEST_SKIP() << "pp=2 on 2 ranks";
  for (const std::string layout : {"pp=2,tsp=1", "pp=2,tp=1"}) {
    auto cpu = make_cpu_backend();
    Result<GenerationReport> plain = generate_with(layout, *cpu, {});
    ASSERT_TRUE(plain.ok()) << plain.status().to_string();
    GuardedRun g;
    Result<GenerationReport> guarded = generate_with(layout, *g.backend, g.axis_comm());
    ASSERT_TRUE(guarded.ok()) << guarded.status().to_string();
    EXPECT_GT(g.guard.windows_opened(), 10);
    ASSERT_EQ(guarded->completions.size(), plain->completions.size());
    for (size_t i = 0; i < plain->completions.size(); ++i)
      EXPECT_EQ(guarded->completions[i].tokens, plain->completions[i].tokens) << layout << " prompt " << i;
  }
}

}  // namespace
}  // namespace foldpar
