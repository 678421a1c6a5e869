// Tensor-parallel traffic: the calls and bytes each rank counts (comm/comm_stats.h
// convention), per operation kind, for one layer, forward and backward, equal docs/tsp.md section
// 7's TP row and the backward formulas written in parallel/tp/tp_model.h, with and without
// sequence parallelism and recompute; and a whole 1-layer step equals the sum of every term
// (embedding, head, loss, ids). One layer is the difference between a 2-layer and a 1-layer
// model (everything else is identical between the two). Nothing but all_reduce, all_gather
// and reduce_scatter is ever called.
#include <gtest/gtest.h>

#include <map>

#include "app/synthetic.h"
#include "comm/comm_stats.h"
#include "mpi_test_main.h"
#include "parallel/tp/tp_model.h"

namespace foldpar {
namespace {

LlamaConfig traffic_config(int T, int layers) {
  LlamaConfig c;
  c.hidden_size = 96;  // divisible by every T here, so every all-reduce splits evenly
  c.num_attention_heads = 12;
  c.num_key_value_heads = T == 3 ? 6 : 4;  // g = 2 or 3
  c.intermediate_size = 144;
  c.vocab_size = 120;
  c.num_hidden_layers = layers;
  c.max_position_embeddings = 512;
  return c;
}

constexpr int64_t kBatch = 2;
int64_t seq_for(int T) { return 12 * T; }

struct Policy {
  const char* name;
  bool sequence_parallel;
  Recompute recompute;
  bool overlap;
};

void PrintTo(const Policy& p, std::ostream* os) { *os << p.name; }

CommStats run(int layers, const Policy& pol, bool backward) {
  Communicator& world = test::mpi().world();
  const int T = world.size(), t = world.rank();
  const LlamaConfig c = traffic_config(T, layers);
  TpOptions opt;
  opt.sequence_parallel = pol.sequence_parallel;
  opt.recompute = pol.recompute;
  opt.overlap = pol.overlap;
  Result<TpModel> m = TpModel::create(c, T, t, seq_for(T), opt);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  ShardedWeights w = ShardedWeights::allocate(c, m->dims(), t, DType::kF32, MemCategory::kParameters);
  init_sharded_weights(InitOptions{.seed = 1}, w);
  ShardedWeights g = ShardedWeights::allocate(c, m->dims(), t, DType::kF32, MemCategory::kGradients);
  g.zero();
  const Batch local = m->local_batch(synthetic_batch(c, kBatch, seq_for(T), 3));
  auto be = make_cpu_backend();
  ScopedCommCounter counter(world);
  if (backward) {
    EXPECT_TRUE(m->forward_backward(*be, world, w, local, g).ok());
  } else {
    EXPECT_TRUE(m->forward(*be, world, w, local).ok());
  }
  return counter.delta();
}

// Expected counters per kind: calls and elements (f32 or i32, 4 bytes), each sent and
// received (every term here is symmetric under the convention).
struct Expected {
  std::map<CommOpKind, std::pair<uint64_t, uint64_t>> ops;  // kind -> (calls, elements)
  void add(CommOpKind kind, uint64_t calls, uint64_t elements) {
    ops[kind].first += calls;
    ops[kind].second += elements;
  }
};

// Every kind: the expected calls and bytes, 0 for kinds not listed.
void expect_counters(const CommStats& got, const Expected& want, const std::string& what) {
  for (int i = 0; i < kNumCommOpKinds; ++i) {
    const CommOpKind kind = static_cast<CommOpKind>(i);
    const auto it = want.ops.find(kind);
    const uint64_t calls = it == want.ops.end() ? 0 : it->second.first;
    const uint64_t bytes = it == want.ops.end() ? 0 : it->second.second * 4;
    const OpCounters& o = got.op(kind);
    EXPECT_EQ(o.calls, calls) << what << ": " << comm_op_name(kind) << " calls";
    EXPECT_EQ(o.bytes_sent, bytes) << what << ": " << comm_op_name(kind) << " bytes sent";
    EXPECT_EQ(o.bytes_received, bytes) << what << ": " << comm_op_name(kind) << " bytes received";
  }
}

// The formulas. n = B*S*h (one [B, S, h] activation), G(x) = x (T-1)/T: what one all_gather
// or reduce_scatter of x elements in total moves per rank; an all_reduce of x moves 2 G(x).
struct Formulas {
  int T;
  uint64_t n, tokens, h, L;
  uint64_t G(uint64_t x) const { return x * static_cast<uint64_t>(T - 1) / static_cast<uint64_t>(T); }

  // One layer, forward (docs/tsp.md section 7: 4 B S h (T-1)/T either way).
  Expected layer_forward(bool sp) const {
    Expected e;
    if (sp) {
      e.add(CommOpKind::kAllGather, 2, 2 * G(n));      // f' before Q/K/V and gate/up
      e.add(CommOpKind::kReduceScatter, 2, 2 * G(n));  // g' after Wo and Wdown
    } else {
      e.add(CommOpKind::kAllReduce, 2, 2 * 2 * G(n));  // g after Wo and Wdown
    }
    return e;
  }
  // One layer, what backward adds (forward_backward minus forward).
  Expected layer_backward(bool sp, bool recompute) const {
    Expected e;
    if (recompute) e = layer_forward(sp);  // the rerun
    if (sp) {
      e.add(CommOpKind::kAllGather, 2, 2 * G(n));      // dY of both sub-blocks (g'^T)
      e.add(CommOpKind::kReduceScatter, 2, 2 * G(n));  // dX of both column-parallel GEMMs (f'^T)
      if (!recompute) e.add(CommOpKind::kAllGather, 2, 2 * G(n));  // norm outputs gathered again
      e.add(CommOpKind::kAllReduce, 0, 2 * G(2 * h));  // two more gains in the packed norm all-reduce
    } else {
      e.add(CommOpKind::kAllReduce, 2, 2 * 2 * G(n));  // dX of both column-parallel GEMMs (f^T)
    }
    return e;
  }
  // A whole step of L layers.
  Expected step(bool sp, bool recompute, bool backward) const {
    Expected e;
    auto add_all = [&](const Expected& x, uint64_t times) {
      for (const auto& [kind, v] : x.ops) e.add(kind, v.first * times, v.second * times);
    };
    add_all(layer_forward(sp), L);
    e.add(CommOpKind::kAllReduce, 2, 2 * G(tokens) + 2 * G(2 * tokens));  // loss: maxima, then sums
    if (sp) {
      e.add(CommOpKind::kAllGather, 1, G(2 * tokens));  // ids and targets (i32)
      e.add(CommOpKind::kReduceScatter, 1, G(n));       // embedding (g')
      e.add(CommOpKind::kAllGather, 1, G(n));           // xf before the LM head (f')
    } else {
      e.add(CommOpKind::kAllReduce, 1, 2 * G(n));  // embedding (g)
    }
    if (!backward) return e;
    add_all(layer_backward(sp, recompute), L);
    if (sp) {
      e.add(CommOpKind::kReduceScatter, 1, G(n));  // d_xf (f'^T)
      e.add(CommOpKind::kAllGather, 1, G(n));      // embedding dX (g'^T)
      e.add(CommOpKind::kAllReduce, 1, 2 * G(h));  // the packed norm gains: final norm (layers' parts above)
    } else {
      e.add(CommOpKind::kAllReduce, 1, 2 * G(n));  // d_xf (f^T)
    }
    return e;
  }
};

Formulas formulas(int layers) {
  const int T = test::mpi().world().size();
  const LlamaConfig c = traffic_config(T, layers);
  const uint64_t tokens = static_cast<uint64_t>(kBatch * seq_for(T)), h = static_cast<uint64_t>(c.hidden_size);
  return Formulas{T, tokens * h, tokens, h, static_cast<uint64_t>(layers)};
}

CommStats difference(const CommStats& two, const CommStats& one) { return two - one; }

class TpTraffic : public ::testing::TestWithParam<Policy> {};

TEST_P(TpTraffic, OneLayerForwardAndBackwardEqualTheFormulas) {
  const Policy pol = GetParam();
  const bool sp = pol.sequence_parallel, rc = pol.recompute == Recompute::kBlock;
  const Formulas F = formulas(1);
  const CommStats f1 = run(1, pol, false), f2 = run(2, pol, false);
  expect_counters(difference(f2, f1), F.layer_forward(sp), "one layer forward");
  const CommStats b1 = run(1, pol, true), b2 = run(2, pol, true);
  expect_counters(difference(difference(b2, b1), difference(f2, f1)), F.layer_backward(sp, rc),
                  "one layer backward");
  // docs/tsp.md section 7's TP row, whatever the mapping: 4 B S h (T-1)/T elements forward.
  const CommStats layer = difference(f2, f1);
  const uint64_t moved = layer.total().bytes_received / 4;
  EXPECT_EQ(moved, 4 * F.G(F.n));
}

TEST_P(TpTraffic, WholeStepEqualsTheSumOfItsTerms) {
  const Policy pol = GetParam();
  const bool sp = pol.sequence_parallel, rc = pol.recompute == Recompute::kBlock;
  for (int layers : {1, 2}) {
    const Formulas F = formulas(layers);
    expect_counters(run(layers, pol, false), F.step(sp, rc, false), "forward, L=" + std::to_string(layers));
    expect_counters(run(layers, pol, true), F.step(sp, rc, true), "forward+backward, L=" + std::to_string(layers));
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, TpTraffic,
                         ::testing::Values(Policy{"plain", false, Recompute::kNone, true},
                                           Policy{"plain_recompute", false, Recompute::kBlock, true},
                                           Policy{"plain_no_overlap", false, Recompute::kNone, false},
                                           Policy{"sp", true, Recompute::kNone, true},
                                           Policy{"sp_recompute", true, Recompute::kBlock, false},
                                           Policy{"sp_no_overlap", true, Recompute::kNone, false}),
                         [](const ::testing::TestParamInfo<Policy>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace foldpar
