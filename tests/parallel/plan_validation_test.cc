// The plan against measurement: for several layouts at small scale, one training step's
// tracked peak per rank (tensor/memory_tracker.h) is within 10% of plan/memory_model.h's
// prediction, and the bytes and calls every communicator counts (comm/comm_stats.h), per
// operation kind, equal plan/traffic_model.h's exactly. Forward-only steps are held to the
// same bars. Runs at 2 ranks (every 2-rank layout: tsp, tp, tp with seqpar, sp with both
// exchanges, the two degenerate tp x sp meshes; tsp's policies and bf16 storage) over two
// sequence lengths (and B = 2); at 4 ranks tsp=4 and the 2-D meshes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "app/layout_bench.h"
#include "app/synthetic.h"
#include "backend/bf16_storage_backend.h"
#include "comm/comm_stats.h"
#include "comm/mesh.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"
#include "plan/memory_model.h"
#include "plan/traffic_model.h"

namespace foldpar {
namespace {

// f = 3h (not a multiple of the TP block sizes), GQA g = 2, untied, two layers.
LlamaConfig plan_config() {
  LlamaConfig c;
  c.hidden_size = 128;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.intermediate_size = 384;
  c.vocab_size = 256;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 8192;
  return c;
}

struct Measured {
  int64_t peak = 0;
  std::vector<std::pair<std::string, CommStats>> axes;
};

// One step under `spec`, measured from before the model exists, as layout_bench does.
Measured measure(const Layout& spec, int64_t B, int64_t S, bool train) {
  Communicator& world = test::mpi().world();
  Result<Mesh> mesh = Mesh::create(world, spec.mesh());
  FP_CHECK_OK(mesh.status());
  // One data-parallel replica's rows: the plan splits the global batch over dp.
  const Batch global = synthetic_batch(plan_config(), B / spec.dp, S, 3);
  MemoryTracker& mt = MemoryTracker::process();
  mt.release_cache();
  const int64_t base = mt.stats().current_total;
  mt.reset_peaks();
  Measured out;
  {
    Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(plan_config(), *mesh, S, spec);
    FP_CHECK_OK(m.status());
    (*m)->init_weights(InitOptions{.seed = 1});
    const Batch local = (*m)->local_batch(global);
    auto cpu = make_cpu_backend();
    std::unique_ptr<Backend> bf16 = (spec.dtype == DType::kBF16) ? make_bf16_storage_backend(*cpu) : nullptr;
    Backend* be = bf16 ? bf16.get() : cpu.get();
    std::vector<const Communicator*> comms;
    std::vector<std::string> names;
    for (const char* axis : {"tsp", "tp", "sp"}) {
      if (!mesh->has_axis(axis)) continue;
      comms.push_back(&mesh->comm(axis));
      names.push_back(axis);
    }
    ScopedCommCounter counter(comms);
    Result<StepResult> r = train ? (*m)->forward_backward(*be, local, 0) : (*m)->forward(*be, local);
    FP_CHECK_OK(r.status());
    for (size_t i = 0; i < comms.size(); ++i) out.axes.emplace_back(names[i], counter.delta(*comms[i]));
    out.peak = mt.stats().peak_total - base;
  }
  mt.release_cache();
  return out;
}

RankCoords coords_of(const Layout& spec) {
  Result<Mesh> mesh = Mesh::create(test::mpi().world(), spec.mesh());
  FP_CHECK_OK(mesh.status());
  RankCoords c;
  c.tp = mesh->coord("tp");
  c.sp = mesh->coord("sp");
  c.tsp = mesh->coord("tsp");
  return c;
}

CommOpKind kind_of(PlanOp op) {
  for (int i = 0; i < kNumCommOpKinds; ++i)
    if (std::string(comm_op_name(static_cast<CommOpKind>(i))) == plan_op_name(op)) return static_cast<CommOpKind>(i);
  ADD_FAILURE() << "no comm op named " << plan_op_name(op);
  return CommOpKind::kBarrier;
}

void check(const std::string& text, int64_t B, int64_t S, bool train) {
  const int rank = test::mpi().world().rank();
  Result<Layout> spec = parse_layout(text);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  const PlanMode mode = train ? PlanMode::kTrain : PlanMode::kForward;
  const std::string what = fmt::format("{} B={} S={} {}", text, B, S, plan_mode_name(mode));
  SCOPED_TRACE(what);
  const Measured got = measure(*spec, B, S, train);

  // Traffic: exact, per axis, per kind, calls and bytes both ways.
  Result<StepTraffic> traffic = predict_traffic(plan_config(), *spec, B, S, mode, coords_of(*spec));
  ASSERT_TRUE(traffic.ok()) << traffic.status().to_string();
  for (const auto& [axis, stats] : got.axes) {
    const AxisTraffic* want = traffic->axis(axis);
    ASSERT_NE(want, nullptr) << "no predicted traffic on " << axis;
    uint64_t counted_kinds = 0;
    for (int i = 0; i < kNumPlanOps; ++i) {
      const PlanOp op = static_cast<PlanOp>(i);
      const OpCounters& c = stats.op(kind_of(op));
      const OpBytes& w = want->op(op);
      EXPECT_EQ(c.calls, w.calls) << axis << " " << plan_op_name(op) << " calls";
      EXPECT_EQ(c.bytes_sent, w.bytes_sent) << axis << " " << plan_op_name(op) << " bytes sent";
      EXPECT_EQ(c.bytes_received, w.bytes_received) << axis << " " << plan_op_name(op) << " bytes received";
      counted_kinds += c.calls;
    }
    EXPECT_EQ(counted_kinds, stats.total().calls) << axis << ": an operation kind the plan does not know";
  }

  // Memory: the tracked peak of this rank within 10% of the prediction.
  MemoryRequest req;
  req.batch = B;
  req.seq = S;
  req.mode = mode;
  Result<MemoryEstimate> mem = predict_memory(plan_config(), *spec, req);
  ASSERT_TRUE(mem.ok()) << mem.status().to_string();
  const double ratio = static_cast<double>(mem->peak) / static_cast<double>(got.peak);
  if (rank == 0)
    std::printf("[plan] %-26s measured %9.3f MiB  predicted %9.3f MiB  ratio %.3f  (%s)\n", what.c_str(),
                got.peak / 1048576.0, mem->peak / 1048576.0, ratio, mem->phase.c_str());
  EXPECT_NEAR(ratio, 1.0, 0.10) << "measured " << got.peak << " B, predicted " << mem->peak << " B at "
                                << mem->phase;
}

class PlanValidation : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (test::mpi().world().size() != 2) GTEST_SKIP() << "the layouts are written for 2 ranks";
  }
};

TEST_P(PlanValidation, TrainingStepPeakWithinTenPercentAndTrafficExact) {
  for (int64_t S : {256, 1024}) check(GetParam(), 1, S, true);
  check(GetParam(), 2, 512, true);
}

TEST_P(PlanValidation, ForwardPeakWithinTenPercentAndTrafficExact) { check(GetParam(), 1, 1024, false); }

INSTANTIATE_TEST_SUITE_P(Layouts, PlanValidation,
                         ::testing::Values("tsp=2", "tsp=2:bf16", "tsp=2:keepw:keepkv", "tsp=2:recompute", "tsp=2:buckets=2:nooverlap",
                                           "tp=2", "tp=2:seqpar", "tp=2:recompute", "sp=2", "sp=2:ring",
                                           "sp=2:recompute", "tp=2+sp=1", "tp=1+sp=2:ring", "tp=2+sp=1:seqpar"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           std::string n = i.param;
                           for (char& ch : n)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// Generation's prefill (tsp and tp decoders: weights, the KV cache sized for the new
// tokens, the forward without the LM-head ring) against the plan's prefill estimate.
TEST(PlanValidationPrefill, PeakWithinTenPercent) {
  Communicator& world = test::mpi().world();
  if (world.size() != 2) GTEST_SKIP() << "written for 2 ranks";
  const int64_t S = 1024, new_tokens = 64;
  for (const char* text : {"tsp=2", "tp=2"}) {
    SCOPED_TRACE(text);
    const Layout spec = *parse_layout(text);
    Result<Mesh> mesh = Mesh::create(world, spec.mesh());
    ASSERT_TRUE(mesh.ok());
    const Batch prompt = synthetic_batch(plan_config(), 1, S, 5);
    const std::vector<std::vector<int32_t>> prompts{
        std::vector<int32_t>(prompt.input_ids.data<int32_t>(), prompt.input_ids.data<int32_t>() + S)};
    MemoryTracker& mt = MemoryTracker::process();
    mt.release_cache();
    const int64_t base = mt.stats().current_total;
    mt.reset_peaks();
    int64_t peak = 0;
    {
      Result<std::unique_ptr<ShardedDecoder>> dec = make_sharded_decoder(plan_config(), *mesh, spec);
      ASSERT_TRUE(dec.ok()) << dec.status().to_string();
      (*dec)->init_weights(InitOptions{.seed = 1});
      auto be = make_cpu_backend();
      ASSERT_TRUE((*dec)->prefill(*be, prompts, new_tokens).ok());
      peak = mt.stats().peak_total - base;
    }
    mt.release_cache();
    MemoryRequest req;
    req.seq = S;
    req.mode = PlanMode::kPrefill;
    req.max_new_tokens = new_tokens;
    Result<MemoryEstimate> mem = predict_memory(plan_config(), spec, req);
    ASSERT_TRUE(mem.ok()) << mem.status().to_string();
    const double ratio = static_cast<double>(mem->peak) / static_cast<double>(peak);
    if (world.rank() == 0)
      std::printf("[plan] %-26s measured %9.3f MiB  predicted %9.3f MiB  ratio %.3f  (%s)\n",
                  fmt::format("{} prefill S={}", text, S).c_str(), peak / 1048576.0, mem->peak / 1048576.0, ratio,
                  mem->phase.c_str());
    EXPECT_NEAR(ratio, 1.0, 0.10) << "measured " << peak << " B, predicted " << mem->peak << " B";
  }
}

// Generation's decode steps (after a prefill: weights and the KV cache stay, each step adds
// O(B h + B V/D) transients) against the plan's decode estimate. The KV cache and the
// parameters are exact (the cache never grows after prefill); the peak within 10%.
TEST(PlanValidationDecode, CacheExactAndPeakWithinTenPercent) {
  Communicator& world = test::mpi().world();
  if (world.size() != 2) GTEST_SKIP() << "written for 2 ranks";
  const int64_t S = 1024, new_tokens = 64, steps = 8;
  for (const char* text : {"tsp=2", "tp=2"}) {
    for (const int64_t B : {int64_t{1}, int64_t{4}}) {
      SCOPED_TRACE(fmt::format("{} B={}", text, B));
      const Layout spec = *parse_layout(text);
      Result<Mesh> mesh = Mesh::create(world, spec.mesh());
      ASSERT_TRUE(mesh.ok());
      const Batch prompt = synthetic_batch(plan_config(), B, S, 7);
      std::vector<std::vector<int32_t>> prompts;
      for (int64_t b = 0; b < B; ++b) {
        const int32_t* row = prompt.input_ids.data<int32_t>() + b * S;
        prompts.emplace_back(row, row + S);
      }
      MemoryTracker& mt = MemoryTracker::process();
      mt.release_cache();
      const int64_t base = mt.stats().current_total;
      MemoryStats at_peak;
      int64_t peak = 0;
      {
        Result<std::unique_ptr<ShardedDecoder>> dec = make_sharded_decoder(plan_config(), *mesh, spec);
        ASSERT_TRUE(dec.ok()) << dec.status().to_string();
        (*dec)->init_weights(InitOptions{.seed = 1});
        auto be = make_cpu_backend();
        {
          Result<Tensor> logits = (*dec)->prefill(*be, prompts, new_tokens);
          ASSERT_TRUE(logits.ok()) << logits.status().to_string();
        }
        mt.reset_peaks();
        std::vector<int32_t> tokens(static_cast<size_t>(B));
        for (int64_t step = 0; step < steps; ++step) {
          for (int64_t b = 0; b < B; ++b) tokens[static_cast<size_t>(b)] = static_cast<int32_t>((step * 31 + b) % 256);
          Result<Tensor> logits = (*dec)->decode(*be, tokens);
          ASSERT_TRUE(logits.ok()) << logits.status().to_string();
        }
        at_peak = mt.stats();
        peak = at_peak.peak_total - base;
      }
      mt.release_cache();
      MemoryRequest req;
      req.batch = B;
      req.seq = S;
      req.mode = PlanMode::kDecode;
      req.max_new_tokens = new_tokens;
      req.count_batch = false;
      Result<MemoryEstimate> mem = predict_memory(plan_config(), spec, req);
      ASSERT_TRUE(mem.ok()) << mem.status().to_string();
      // Neither category changes during decode: their current bytes are what the peak held.
      EXPECT_EQ(mem->of(MemCategory::kKvCache), at_peak.current_of(MemCategory::kKvCache));
      EXPECT_EQ(mem->of(MemCategory::kParameters), at_peak.current_of(MemCategory::kParameters));
      const double ratio = static_cast<double>(mem->peak) / static_cast<double>(peak);
      if (world.rank() == 0)
        std::printf("[plan] %-26s measured %9.3f MiB  predicted %9.3f MiB  ratio %.3f  (cache %.3f MiB)\n",
                    fmt::format("{} decode B={}", text, B).c_str(), peak / 1048576.0, mem->peak / 1048576.0, ratio,
                    mem->of(MemCategory::kKvCache) / 1048576.0);
      EXPECT_NEAR(ratio, 1.0, 0.10) << "measured " << peak << " B, predicted " << mem->peak << " B";
    }
  }
}

// At 4 ranks: D >= 3 keeps more shards and gradient buffers in flight, tp x sp is a real 2-D
// mesh whose ranks sit at different coordinates, and dp splits the batch.
TEST(PlanValidationFourRanks, TspAndTwoDimensionalMeshes) {
  if (test::mpi().world().size() != 4) GTEST_SKIP() << "written for 4 ranks";
  for (const char* layout : {"tsp=4", "tsp=4:recompute", "tp=2+sp=2", "tp=2+sp=2:ring:seqpar", "tp=4", "sp=4:ring"})
    check(layout, 1, 512, true);
  check("tp=2+sp=2", 1, 512, false);
  // With a dp axis the model axes see B / dp sequences (the dp all-reduce is the trainer's).
  check("dp=2+tsp=2", 2, 512, true);
  check("dp=2+tp=2:seqpar", 4, 256, true);
}

}  // namespace
}  // namespace foldpar
