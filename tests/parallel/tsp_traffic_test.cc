// TSP traffic: the bytes each rank counts (comm/comm_stats.h convention) for one layer,
// forward and backward, equal the formulas of docs/tsp.md section 7 exactly, for every policy;
// and the vocabulary rings move V*h*(D-1)/D elements per pass. One layer's traffic is
// measured as the difference between a 2-layer and a 1-layer model (everything else is
// identical between the two).
#include <gtest/gtest.h>

#include "app/synthetic.h"
#include "comm/comm_stats.h"
#include "mpi_test_main.h"
#include "parallel/tsp/tsp_model.h"
#include "plan/traffic_model.h"

namespace foldpar {
namespace {

// kv_heads > 0: num_key_value_heads (fewer than D: KV replicas).
LlamaConfig traffic_config(int D, int layers, int64_t head_dim = 0, bool variants = false, int64_t kv_heads = 0) {
  LlamaConfig c;
  c.qkv_bias = c.o_bias = c.qk_norm = variants;  // qwen3 with attention_bias: every variant at once
  c.explicit_head_dim = head_dim;  // 0: h / n_h = 8
  c.hidden_size = 96;  // divisible by every D here, so the norm all-reduce splits evenly
  c.num_attention_heads = 12;
  c.num_key_value_heads = kv_heads > 0 ? kv_heads : D == 3 ? 6 : 4;  // g = 2 or 3
  c.intermediate_size = 144;
  c.vocab_size = 120;
  c.num_hidden_layers = layers;
  c.max_position_embeddings = 512;
  return c;
}

CommStats run(int layers, Layout opt, bool backward, int64_t B, int64_t S, int64_t head_dim = 0,
              bool variants = false, int64_t kv_heads = 0) {
  Communicator& world = test::mpi().world();
  const int D = world.size(), p = world.rank();
  const LlamaConfig c = traffic_config(D, layers, head_dim, variants, kv_heads);
  opt.tsp = D;
  Result<TspModel> m = TspModel::create(c, opt, p, S);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  ShardedWeights w = ShardedWeights::allocate(c, m->dims(), p, DType::kF32, MemCategory::kParameters);
  init_sharded_weights(InitOptions{.seed = 1}, w);
  ShardedWeights g = ShardedWeights::allocate(c, m->dims(), p, DType::kF32, MemCategory::kGradients);
  g.zero();
  const Batch local = m->shard().local_batch(synthetic_batch(c, B, S, 3));
  auto be = make_cpu_backend();
  ScopedCommCounter counter(world);
  if (backward) {
    EXPECT_TRUE(m->forward_backward(*be, world, w, local, g).ok());
  } else {
    EXPECT_TRUE(m->forward(*be, world, w, local).ok());
  }
  return counter.delta();
}

// Elements of one layer, per rank, from docs/tsp.md section 7: W = ((2 + 2/g) h^2 + 3 h f)(D-1)/D split in
// its attention and MLP parts, KV = 2 B S h/g (D-1)/D.
struct LayerFormula {
  uint64_t attn_w, mlp_w, kv, norms;
};
LayerFormula formula(const LlamaConfig& c, int D, int64_t B, int64_t S) {
  const uint64_t h = c.hidden_size, f = c.intermediate_size, g = c.group();
  LayerFormula F;
  F.attn_w = (2 * h * h + 2 * h * h / g) * (D - 1) / D;
  F.mlp_w = 3 * h * f * (D - 1) / D;
  F.kv = 2 * B * S * h / g * (D - 1) / D;
  F.norms = 2 * (2 * h) * (D - 1) / D;  // two more norm gains in the packed all-reduce (ring convention)
  return F;
}

void expect_layer(const CommStats& one, const CommStats& two, CommOpKind kind, uint64_t elements,
                  const char* what) {
  const OpCounters a = one.op(kind), b = two.op(kind);
  EXPECT_EQ(b.bytes_received - a.bytes_received, elements * 4) << what << " received";
  EXPECT_EQ(b.bytes_sent - a.bytes_sent, elements * 4) << what << " sent";
}

struct Policy {
  const char* name;
  bool keep_weights, keep_kv;
  int buckets;
  bool overlap;
};

class TspTraffic : public ::testing::TestWithParam<Policy> {};

TEST_P(TspTraffic, OneLayerForwardAndBackwardEqualTheFormulas) {
  const Policy pol = GetParam();
  const int D = test::mpi().world().size();
  const int64_t B = 2, S = 12 * D;
  Layout opt;
  opt.keep_weights = pol.keep_weights;
  opt.keep_kv = pol.keep_kv;
  opt.head_buckets = (traffic_config(D, 1).num_key_value_heads / D) % pol.buckets == 0 ? pol.buckets : 1;
  opt.overlap = pol.overlap;
  const LayerFormula F = formula(traffic_config(D, 1), D, B, S);

  // Forward: the attention shards once (broadcast), K/V once (all-gather), the MLP ring once.
  const CommStats f1 = run(1, opt, false, B, S), f2 = run(2, opt, false, B, S);
  expect_layer(f1, f2, CommOpKind::kBroadcast, F.attn_w, "forward attention weights");
  expect_layer(f1, f2, CommOpKind::kAllGather, F.kv, "forward K/V");
  expect_layer(f1, f2, CommOpKind::kSendRecv, F.mlp_w, "forward MLP ring");
  expect_layer(f1, f2, CommOpKind::kReduce, 0, "forward reduce");
  expect_layer(f1, f2, CommOpKind::kReduceScatter, 0, "forward reduce-scatter");
  expect_layer(f1, f2, CommOpKind::kAllReduce, 0, "forward all-reduce");
  // The number of collectives: D broadcasts and 2 B all-gathers per unit.
  EXPECT_EQ(f2.op(CommOpKind::kBroadcast).calls - f1.op(CommOpKind::kBroadcast).calls, static_cast<uint64_t>(D));
  EXPECT_EQ(f2.op(CommOpKind::kAllGather).calls - f1.op(CommOpKind::kAllGather).calls,
            static_cast<uint64_t>(D * opt.head_buckets * 2 * B));

  // Forward + backward: weights again unless kept, gradients home, K/V again unless kept,
  // dK/dV reduce-scattered, the MLP ring twice more (weights and gradients).
  const CommStats b1 = run(1, opt, true, B, S), b2 = run(2, opt, true, B, S);
  expect_layer(b1, b2, CommOpKind::kBroadcast, F.attn_w * (opt.keep_weights ? 1 : 2), "attention weights");
  expect_layer(b1, b2, CommOpKind::kReduce, F.attn_w, "attention weight gradients");
  expect_layer(b1, b2, CommOpKind::kAllGather, F.kv * (opt.keep_kv ? 1 : 2), "K/V");
  expect_layer(b1, b2, CommOpKind::kReduceScatter, F.kv, "dK/dV");
  expect_layer(b1, b2, CommOpKind::kSendRecv, 3 * F.mlp_w, "MLP rings");
  expect_layer(b1, b2, CommOpKind::kAllReduce, F.norms, "norm gains");
  // No activation all-reduce anywhere: the only all-reduces are the loss sums and the one
  // packed norm-gain all-reduce, whatever the number of layers.
  EXPECT_EQ(b2.op(CommOpKind::kAllReduce).calls, 2u);
  EXPECT_EQ(f2.op(CommOpKind::kAllReduce).calls, 1u);
}

// head_dim 20 with h / n_h = 8: the attention shards and K/V grow with n_h * d, not h
// (plan/traffic_model.cc's tsp_forward_layer_elements says the same).
TEST(TspTrafficHeadDim, ForwardMovesQueryWidthNotHidden) {
  const int D = test::mpi().world().size();
  const int64_t B = 2, S = 12 * D, d = 20;
  const LlamaConfig c = traffic_config(D, 1, d);
  const uint64_t h = c.hidden_size, f = c.intermediate_size, q = c.num_attention_heads * d, kv = c.kv_dim();
  const CommStats f1 = run(1, Layout{}, false, B, S, d), f2 = run(2, Layout{}, false, B, S, d);
  expect_layer(f1, f2, CommOpKind::kBroadcast, (2 * h * q + 2 * h * kv) * (D - 1) / D, "forward attention weights");
  expect_layer(f1, f2, CommOpKind::kAllGather, 2 * B * S * kv * (D - 1) / D, "forward K/V");
  expect_layer(f1, f2, CommOpKind::kSendRecv, 3 * h * f * (D - 1) / D, "forward MLP ring");
  const double total = static_cast<double>(2 * h * q + 2 * h * kv + 3 * h * f + 2 * B * S * kv) * (D - 1) / D;
  EXPECT_DOUBLE_EQ(total, tsp_forward_layer_elements(c, B * S, D));
}

INSTANTIATE_TEST_SUITE_P(Policies, TspTraffic,
                         ::testing::Values(Policy{"refetch", false, false, 1, true},
                                           Policy{"keep_weights", true, false, 1, true},
                                           Policy{"keep_kv", false, true, 1, false},
                                           Policy{"keep_both_buckets", true, true, 2, true},
                                           Policy{"buckets_no_overlap", false, false, 2, false}),
                         [](const ::testing::TestParamInfo<Policy>& i) { return std::string(i.param.name); });

// The attention variants are replicated: nothing of them travels with the shards, the
// forward moves what the plain model's does, and the backward adds one all-reduce of their
// gradients, n = L (n_h d + 2 n_kv d + h + 2d) elements (ring convention: 2 n (D-1)/D).
TEST(TspTrafficVariants, BiasAndNormGradientsAddOneAllReduce) {
  const int D = test::mpi().world().size();
  const int64_t B = 2, S = 12 * D, L = 3;  // L = 3: n divides by every D here
  const LlamaConfig c = traffic_config(D, static_cast<int>(L), 0, true);
  const uint64_t n = static_cast<uint64_t>(L * (c.q_dim() + 2 * c.kv_dim() + c.hidden_size + 2 * c.head_dim()));
  ASSERT_EQ(n % static_cast<uint64_t>(D), 0u);
  for (bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "forward and backward" : "forward");
    const CommStats plain = run(static_cast<int>(L), Layout{}, backward, B, S);
    const CommStats variants = run(static_cast<int>(L), Layout{}, backward, B, S, 0, true);
    for (CommOpKind kind : {CommOpKind::kBroadcast, CommOpKind::kAllGather, CommOpKind::kReduce,
                            CommOpKind::kReduceScatter, CommOpKind::kSendRecv}) {
      EXPECT_EQ(variants.op(kind).bytes_sent, plain.op(kind).bytes_sent) << comm_op_name(kind);
      EXPECT_EQ(variants.op(kind).calls, plain.op(kind).calls) << comm_op_name(kind);
    }
    const OpCounters a = plain.op(CommOpKind::kAllReduce), b = variants.op(CommOpKind::kAllReduce);
    EXPECT_EQ(b.calls - a.calls, backward ? 1u : 0u);
    const uint64_t extra = backward ? 2 * n * static_cast<uint64_t>(D - 1) / static_cast<uint64_t>(D) : 0;
    EXPECT_EQ(b.bytes_sent - a.bytes_sent, extra * 4);
    EXPECT_EQ(b.bytes_received - a.bytes_received, extra * 4);
  }
}

// KV replicas (n_kv < D, docs/tsp.md section 3): each KV head's K/V is all-gathered once per
// pass and its dK/dV reduce-scattered once (2 B S n_kv d (D-1)/D elements each, in n_kv x 2B
// calls), every shard's broadcast and gradient reduce carry its replica rows
// ((D-1) (2h/D + 2d) h), and the group's last rank sends its wk/wv gradient rows (2 d h) to
// each of the D/n_kv - 1 other members.
TEST(TspTrafficKvReplicas, EachKvHeadMovesOnceAndTheReplicasGetOneCopy) {
  const int D = test::mpi().world().size(), p = test::mpi().world().rank();
  if (D == 1) GTEST_SKIP() << "no replicas on one rank";
  const int64_t B = 2, S = 12 * D;
  for (int64_t kv : {int64_t{1}, int64_t{2}}) {
    if (kv >= D || D % kv != 0) continue;
    SCOPED_TRACE("n_kv " + std::to_string(kv));
    const LlamaConfig c = traffic_config(D, 1, 0, false, kv);
    const uint64_t h = c.hidden_size, d = c.head_dim(), f = c.intermediate_size, G = D / kv;
    const uint64_t attn_w = (D - 1) * (2 * h / D + 2 * d) * h, kv_elems = 2 * B * S * kv * d * (D - 1) / D;
    const CommStats f1 = run(1, Layout{}, false, B, S, 0, false, kv), f2 = run(2, Layout{}, false, B, S, 0, false, kv);
    expect_layer(f1, f2, CommOpKind::kBroadcast, attn_w, "forward attention weights");
    expect_layer(f1, f2, CommOpKind::kAllGather, kv_elems, "forward K/V");
    expect_layer(f1, f2, CommOpKind::kSendRecv, 3 * h * f * (D - 1) / D, "forward MLP ring");
    EXPECT_EQ(f2.op(CommOpKind::kAllGather).calls - f1.op(CommOpKind::kAllGather).calls,
              static_cast<uint64_t>(kv * 2 * B));
    EXPECT_EQ(f2.op(CommOpKind::kSend).calls, 0u);
    const CommStats b1 = run(1, Layout{}, true, B, S, 0, false, kv), b2 = run(2, Layout{}, true, B, S, 0, false, kv);
    expect_layer(b1, b2, CommOpKind::kBroadcast, 2 * attn_w, "attention weights");
    expect_layer(b1, b2, CommOpKind::kReduce, attn_w, "attention weight gradients");
    expect_layer(b1, b2, CommOpKind::kAllGather, 2 * kv_elems, "K/V");
    expect_layer(b1, b2, CommOpKind::kReduceScatter, kv_elems, "dK/dV");
    EXPECT_EQ(b2.op(CommOpKind::kReduceScatter).calls - b1.op(CommOpKind::kReduceScatter).calls,
              static_cast<uint64_t>(kv * 2 * B));
    const bool last = p % static_cast<int>(G) == static_cast<int>(G) - 1;
    const OpCounters s1 = b1.op(CommOpKind::kSend), s2 = b2.op(CommOpKind::kSend);
    const OpCounters r1 = b1.op(CommOpKind::kRecv), r2 = b2.op(CommOpKind::kRecv);
    EXPECT_EQ(s2.calls - s1.calls, last ? G - 1 : 0u);
    EXPECT_EQ(s2.bytes_sent - s1.bytes_sent, last ? (G - 1) * 2 * d * h * 4 : 0u);
    EXPECT_EQ(r2.calls - r1.calls, last ? 0u : 1u);
    EXPECT_EQ(r2.bytes_received - r1.bytes_received, last ? 0u : 2 * d * h * 4);
  }
}

TEST(TspTrafficVocab, RingsMoveOneVocabularyShardPerHop) {
  // With one layer the send_recv traffic is the layer's MLP rings plus the vocabulary rings:
  // forward: embedding and LM head weights (2 passes); backward: LM head weights again,
  // LM head gradients and embedding gradients (3 passes).
  const int D = test::mpi().world().size();
  const int64_t B = 1, S = 12 * D;
  const LlamaConfig c = traffic_config(D, 1);
  const uint64_t vocab_pass = static_cast<uint64_t>(c.vocab_size * c.hidden_size * (D - 1) / D);
  const LayerFormula F = formula(c, D, B, S);
  const CommStats f = run(1, {}, false, B, S), b = run(1, {}, true, B, S);
  EXPECT_EQ(f.op(CommOpKind::kSendRecv).bytes_received, (F.mlp_w + 2 * vocab_pass) * 4);
  EXPECT_EQ(b.op(CommOpKind::kSendRecv).bytes_received, (3 * F.mlp_w + 5 * vocab_pass) * 4);
  EXPECT_EQ(b.op(CommOpKind::kSendRecv).bytes_sent, (3 * F.mlp_w + 5 * vocab_pass) * 4);
}

}  // namespace
}  // namespace foldpar
