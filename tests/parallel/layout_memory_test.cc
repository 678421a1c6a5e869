// Memory per rank across layouts at the same number of ranks: with B*S at least 8h, TSP's
// tracked peak (parameters, gradients, activations, communication buffers) is below that
// of every baseline: tp=4, sp=4 (both exchanges) and tp=2,sp=2.
#include <gtest/gtest.h>

#include <cstdio>

#include "app/synthetic.h"
#include "comm/mesh.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"

namespace foldpar {
namespace {

LlamaConfig memory_config() {
  LlamaConfig c;
  c.hidden_size = 128;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 8;
  c.intermediate_size = 512;  // f = 4h, as in the paper's model
  c.vocab_size = 256;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 4096;
  return c;
}

// The tracked peak of one training step under `layout`, from before the weights exist.
int64_t step_peak(const std::string& layout, const Batch& global, int64_t seq) {
  Communicator& world = test::mpi().world();
  const Layout lo = parse_layout(layout).value();
  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  EXPECT_TRUE(mesh.ok()) << mesh.status().to_string();
  MemoryTracker& mt = MemoryTracker::process();
  mt.release_cache();
  const int64_t base = mt.stats().current_total;
  mt.reset_peaks();
  int64_t peak = 0;
  {
    Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(memory_config(), *mesh, seq, lo);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    (*m)->init_weights(InitOptions{.seed = 1});
    auto be = make_cpu_backend();
    EXPECT_TRUE((*m)->forward_backward(*be, (*m)->local_batch(global), 0).ok());
    peak = mt.stats().peak_total - base;
  }
  // The worst rank is what has to fit.
  FP_CHECK_OK(world.all_reduce(&peak, &peak, 1, DType::kI64, ReduceOp::kMax));
  return peak;
}

TEST(LayoutMemory, TspPeakIsBelowEveryBaselineWhenTokensExceedEightH) {
  Communicator& world = test::mpi().world();
  if (world.size() != 4) GTEST_SKIP() << "the comparison runs at 4 ranks";
  const LlamaConfig c = memory_config();
  const int64_t B = 1, S = 2048;
  ASSERT_GE(B * S, 8 * c.hidden_size);
  const Batch global = synthetic_batch(c, B, S, 3);
  const int64_t tsp = step_peak("tsp=4", global, S);
  for (const std::string layout : {"tp=4", "sp=4", "sp=4:ring", "tp=2,sp=2"}) {
    const int64_t peak = step_peak(layout, global, S);
    if (world.rank() == 0)
      std::printf("[memory] %-10s peak %.2f MiB per rank (tsp=4: %.2f MiB)\n", layout.c_str(), peak / 1048576.0,
                  tsp / 1048576.0);
    EXPECT_LT(tsp, peak) << layout << ": tsp=4 peaks at " << tsp << " B, " << layout << " at " << peak << " B";
  }
}

}  // namespace
}  // namespace foldpar
