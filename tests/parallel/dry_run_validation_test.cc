// The dry run (plan/dry_run.h) against a real run of the same code: for each layout at this
// many ranks, every rank's dry run as that rank gives exactly the tracked peak (total and
// per category) of the real step and exactly the calls and bytes each axis communicator
// counts, for training and forward-only steps. Layouts whose strategy still touches tensor
// data on the host cannot dry-run yet and skip, naming the access
// (tests/unit/dry_run_test.cc finds them).
#include <gtest/gtest.h>

#include "app/synthetic.h"
#include "comm/counting_communicator.h"
#include "comm/mesh.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"
#include "plan/dry_run.h"

namespace foldpar {
namespace {

LlamaConfig validation_config() {
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
  MemoryStats step;  // peaks from after the model and the local batch exist
  std::array<int64_t, kNumMemCategories> base{};
  int64_t base_total = 0;
  // The local batch's bytes when the strategy's local_batch hands back the global batch
  // itself (tp: every rank holds all tokens): the global batch exists before the base is
  // read, so the real step does not count it, while the dry run always makes the rank's
  // rows (under activations, as local_batch's copies are).
  int64_t aliased_batch_bytes = 0;
  std::vector<std::pair<std::string, CommStats>> axes;
};

// One real step of `lo` on this rank, measured as the dry run measures it.
Measured measure(const Layout& lo, int64_t B, int64_t S, DryRunMode mode) {
  Communicator& world = test::mpi().world();
  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  FP_CHECK_OK(mesh.status());
  const Batch global = synthetic_batch(validation_config(), B / lo.dp, S, 3);
  MemoryTracker& mt = MemoryTracker::process();
  mt.release_cache();
  Measured out;
  const MemoryStats before = mt.stats();
  out.base = before.current;
  out.base_total = before.current_total;
  {
    Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(validation_config(), *mesh, S, lo);
    FP_CHECK_OK(m.status());
    (*m)->init_weights(InitOptions{.seed = 1});
    const Batch local = (*m)->local_batch(global);
    if (local.input_ids.shares_storage_with(global.input_ids)) {
      out.aliased_batch_bytes = static_cast<int64_t>(local.input_ids.nbytes() + local.target_ids.nbytes());
    }
    auto be = make_cpu_backend();
    mt.reset_peaks();
    ScopedCommCounter counter(mesh->communicators());
    if (mode == DryRunMode::kForwardBackward) {
      FP_CHECK_OK((*m)->forward_backward(*be, local, B * S).status());
    } else {
      FP_CHECK_OK((*m)->forward(*be, local).status());
    }
    out.step = mt.stats();
    for (const Communicator* c : mesh->communicators()) out.axes.emplace_back(c->name(), counter.delta(*c));
  }
  return out;
}

struct Case {
  const char* layout;
  int ranks;
  DryRunMode mode;
  const char* host_access = nullptr;  // what still stops the dry run (the case skips)
};

// One op sequence on the MPI world and on a counting communicator playing this rank: the
// same counters, kind by kind, and the trace's bytes are ring_traffic's.
TEST(CountingCommunicatorVsMpi, SameCountersForTheSameOperations) {
  Communicator& world = test::mpi().world();
  EventOrder order;
  CommTrace trace;
  CountingCommunicator counting(world.rank(), world.size(), "world", world.world_ranks(), order, trace);
  const int n = world.size(), p = world.rank();
  std::vector<float> a(64 * n, 1.0f), b(64 * n, 0.0f);
  std::vector<size_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = 3 + r;
  std::vector<CommStats> moved;
  for (Communicator* c : {&world, static_cast<Communicator*>(&counting)}) {
    const CommStats before = c->stats();
    ASSERT_TRUE(c->broadcast(a.data(), 17, DType::kF32, n - 1).ok());
    ASSERT_TRUE(c->all_reduce(a.data(), b.data(), 37, DType::kF32, ReduceOp::kSum).ok());
    ASSERT_TRUE(c->reduce(a.data(), b.data(), 5, DType::kF32, ReduceOp::kSum, 0).ok());
    ASSERT_TRUE(c->all_gather(a.data(), b.data(), 9, DType::kF32).ok());
    ASSERT_TRUE(c->all_gather_v(a.data(), b.data(), counts, DType::kF32).ok());
    ASSERT_TRUE(c->reduce_scatter(a.data(), b.data(), 6, DType::kF32, ReduceOp::kSum).ok());
    ASSERT_TRUE(c->reduce_scatter_v(a.data(), b.data(), counts, DType::kF32, ReduceOp::kSum).ok());
    ASSERT_TRUE(c->all_to_all(a.data(), b.data(), 4, DType::kF32).ok());
    CommRequest r = c->isend_recv(a.data(), b.data(), 11, DType::kF32, (p + 1) % n, (p + n - 1) % n);
    ASSERT_TRUE(r.wait().ok());
    ASSERT_TRUE(c->barrier().ok());
    moved.push_back(c->stats() - before);
  }
  EXPECT_EQ(moved[1], moved[0]) << "counting:\n" << moved[1].to_string() << "mpi:\n" << moved[0].to_string();
  EXPECT_EQ(moved[1], counting.stats());
  uint64_t sent = 0, received = 0;
  for (const CommEvent& e : trace.events) {
    if (e.type != CommEvent::Type::kStart) continue;
    sent += e.bytes_sent;
    received += e.bytes_received;
  }
  EXPECT_EQ(sent, counting.stats().total().bytes_sent);
  EXPECT_EQ(received, counting.stats().total().bytes_received);
  EXPECT_EQ(trace.events.size(), 11u);  // 10 starts, 1 completion
}

// The counting mesh of every rank has the coordinates and axis world ranks of the real Mesh.
TEST(CountingMeshVsMpi, SameRanksAsTheSplitMesh) {
  Communicator& world = test::mpi().world();
  int compared = 0;
  for (const char* text : {"tsp=2", "dp=2", "tsp=3", "tsp=4", "tp=2,sp=2", "dp=2,tsp=2", "dp=2,tp=2", "tp=4", "dp=4"}) {
    const MeshLayout layout = MeshLayout::parse(text).value();
    if (layout.num_ranks() != world.size()) continue;
    Result<Mesh> real = Mesh::create(world, layout);
    ASSERT_TRUE(real.ok()) << real.status().to_string();
    EventOrder order;
    CommTrace trace;
    Result<CountingMesh> counting = make_counting_mesh(layout, world.rank(), order, trace);
    ASSERT_TRUE(counting.ok()) << counting.status().to_string();
    for (const MeshAxis& a : layout.axes) {
      EXPECT_EQ(counting->mesh->coord(a.name), real->coord(a.name)) << text << " " << a.name;
      EXPECT_EQ(counting->mesh->comm(a.name).rank(), real->comm(a.name).rank()) << text << " " << a.name;
      EXPECT_EQ(counting->mesh->comm(a.name).size(), real->comm(a.name).size()) << text << " " << a.name;
      EXPECT_EQ(counting->mesh->comm(a.name).world_ranks(), real->comm(a.name).world_ranks()) << text << " " << a.name;
    }
    ++compared;
  }
  EXPECT_GT(compared, 0) << "no layout of " << world.size() << " ranks compared";
}

class DryRunValidation : public testing::TestWithParam<Case> {};

TEST_P(DryRunValidation, PeakAndTrafficEqualTheRealStep) {
  const Case c = GetParam();
  Communicator& world = test::mpi().world();
  if (world.size() != c.ranks) GTEST_SKIP() << c.layout << " runs at " << c.ranks << " ranks";
  if (c.host_access != nullptr) GTEST_SKIP() << c.layout << ": host access to tensor data: " << c.host_access;
  const Layout lo = parse_layout(c.layout).value();
  const int64_t B = 2 * lo.dp, S = 256;
  const Measured real = measure(lo, B, S, c.mode);
  DryRunOptions o;
  o.config = validation_config();
  o.layout = lo;
  o.rank = world.rank();
  o.batch = B;
  o.seq = S;
  o.mode = c.mode;
  Result<DryRunResult> dry = dry_run(o);
  ASSERT_TRUE(dry.ok()) << dry.status().to_string();
  EXPECT_EQ(dry->step.peak_total, real.step.peak_total - real.base_total + real.aliased_batch_bytes)
      << c.layout << " rank " << world.rank();
  for (int k = 0; k < kNumMemCategories; ++k) {
    const int64_t alias = k == static_cast<int>(MemCategory::kActivations) ? real.aliased_batch_bytes : 0;
    EXPECT_EQ(dry->step.peak[k], real.step.peak[k] - real.base[k] + alias)
        << c.layout << " rank " << world.rank() << ": " << mem_category_name(static_cast<MemCategory>(k));
  }
  ASSERT_EQ(dry->comm.size(), real.axes.size());
  for (size_t i = 0; i < real.axes.size(); ++i) {
    EXPECT_EQ(dry->comm[i].first, real.axes[i].first);
    EXPECT_EQ(dry->comm[i].second, real.axes[i].second)
        << c.layout << " axis " << real.axes[i].first << " rank " << world.rank() << "\ndry:\n"
        << dry->comm[i].second.to_string() << "real:\n" << real.axes[i].second.to_string();
  }
}

constexpr DryRunMode kFB = DryRunMode::kForwardBackward, kF = DryRunMode::kForward;
INSTANTIATE_TEST_SUITE_P(
    Layouts, DryRunValidation,
    testing::Values(Case{"tsp=2", 2, kFB}, Case{"tsp=2", 2, kF},
                    Case{"tsp=2:nooverlap", 2, kFB}, Case{"tp=2", 2, kFB},
                    Case{"tp=2:seqpar", 2, kFB}, Case{"sp=2", 2, kFB},
                    Case{"sp=2:ring", 2, kFB}, Case{"tsp=4", 4, kFB},
                    Case{"tp=2,sp=2", 4, kFB}, Case{"dp=2,tsp=2", 4, kFB}),
    [](const testing::TestParamInfo<Case>& i) {
      std::string n = std::string(i.param.layout) + (i.param.mode == kF ? "_fwd" : "_train");
      for (char& ch : n)
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

}  // namespace
}  // namespace foldpar
