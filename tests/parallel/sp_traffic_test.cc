// SP traffic: the bytes each rank counts (comm/comm_stats.h convention) equal the written
// formulas exactly, for both K/V exchanges and every option. Per layer per rank, in
// elements, with KV = 2*B*S*h/g*(S_-1)/S_ (docs/tsp.md section 7, the SP row):
//   forward                 all-gather exchange: KV all_gather;  ring: KV send_recv
//   forward + backward      all-gather: 2 KV all_gather (again in backward; the recompute's
//                           gather is the backward's) + KV reduce_scatter (dK, dV);
//                           ring: 3 KV send_recv (K/V, K/V again, dK/dV home), 4 KV with
//                           recompute (the rerun's ring)
// One layer is the difference between a 2-layer and a 1-layer model. Per step: one
// all_reduce of every parameter's gradient (n f32) and one of the loss sums (2 f64), each
// counted 2n - b[p] - b[next] sent and 2n - b[prev] - b[p] received with b the ring blocks
// (n split into S_ blocks, the first n mod S_ one longer), written out here by hand.
#include <gtest/gtest.h>

#include "app/synthetic.h"
#include "comm/comm_stats.h"
#include "mpi_test_main.h"
#include "parallel/strategies.h"

namespace foldpar {
namespace {

using Exchange = LayoutOptions::KvExchange;

LlamaConfig traffic_config(int layers) {
  LlamaConfig c;
  c.hidden_size = 96;
  c.num_attention_heads = 12;
  c.num_key_value_heads = 4;  // g = 3
  c.intermediate_size = 144;
  c.vocab_size = 120;
  c.num_hidden_layers = layers;
  c.max_position_embeddings = 512;
  return c;
}

CommStats run(int layers, const LayoutOptions& o, bool backward, int64_t B, int64_t S) {
  Communicator& world = test::mpi().world();
  const LlamaConfig c = traffic_config(layers);
  Result<std::unique_ptr<ShardedModel>> m = make_sp_sharded_model(c, world, S, o);
  FP_CHECK_OK(m.status());
  ShardedModel& model = **m;
  model.init_weights(InitOptions{.seed = 1});
  const Batch local = model.local_batch(synthetic_batch(c, B, S, 3));
  auto be = make_cpu_backend();
  ScopedCommCounter counter(world);
  Result<StepResult> r = backward ? model.forward_backward(*be, local, 0) : model.forward(*be, local);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return counter.delta();
}

// Elements of an all_reduce of n by the ring convention, for this rank: {sent, received}.
std::pair<uint64_t, uint64_t> all_reduce_elements(uint64_t n, int N, int p) {
  auto block = [&](int i) { return n / N + (static_cast<uint64_t>(i) < n % N ? 1 : 0); };
  const int next = (p + 1) % N, prev = (p - 1 + N) % N;
  if (N == 1) return {0, 0};
  return {2 * n - block(p) - block(next), 2 * n - block(prev) - block(p)};
}

void expect_layer(const CommStats& one, const CommStats& two, CommOpKind kind, uint64_t elements, const char* what) {
  const OpCounters a = one.op(kind), b = two.op(kind);
  EXPECT_EQ(b.bytes_received - a.bytes_received, elements * 4) << what << " received";
  EXPECT_EQ(b.bytes_sent - a.bytes_sent, elements * 4) << what << " sent";
}

uint64_t layer_calls(const CommStats& one, const CommStats& two, CommOpKind kind) {
  return two.op(kind).calls - one.op(kind).calls;
}

// The whole step's all_reduce traffic: the gradients (forward_backward only) and the loss.
void expect_all_reduce(const CommStats& s, int layers, bool backward) {
  const int N = test::mpi().world().size(), p = test::mpi().world().rank();
  const uint64_t n = static_cast<uint64_t>(traffic_config(layers).parameter_count());
  const auto [loss_sent, loss_received] = all_reduce_elements(2, N, p);
  const auto [grad_sent, grad_received] = backward ? all_reduce_elements(n, N, p) : std::pair<uint64_t, uint64_t>{};
  EXPECT_EQ(s.op(CommOpKind::kAllReduce).bytes_sent, grad_sent * 4 + loss_sent * 8) << layers << " layers";
  EXPECT_EQ(s.op(CommOpKind::kAllReduce).bytes_received, grad_received * 4 + loss_received * 8) << layers << " layers";
  EXPECT_EQ(s.op(CommOpKind::kAllReduce).calls, backward ? 2u : 1u) << "one packed gradient all-reduce, one loss";
}

struct Policy {
  const char* name;
  Exchange exchange;
  bool overlap;
  Recompute recompute;
  SeqSplit split;
};

class SpTraffic : public ::testing::TestWithParam<Policy> {};

TEST_P(SpTraffic, OneLayerEqualsTheFormulasAndOneGradientAllReducePerStep) {
  const Policy pol = GetParam();
  const int N = test::mpi().world().size();
  const uint64_t B = 2, S = 12 * N;
  LayoutOptions o;
  o.kv_exchange = pol.exchange;
  o.overlap = pol.overlap;
  o.recompute = pol.recompute;
  o.split = pol.split;
  const LlamaConfig c = traffic_config(1);
  const uint64_t h = c.hidden_size, g = c.group();
  const uint64_t KV = 2 * B * S * h / g * (N - 1) / N;  // docs/tsp.md section 7, SP row
  const bool ring = pol.exchange == Exchange::kRing, recompute = pol.recompute == Recompute::kBlock;
  const uint64_t hops = static_cast<uint64_t>(N - 1);

  const CommStats f1 = run(1, o, false, B, S), f2 = run(2, o, false, B, S);
  expect_layer(f1, f2, CommOpKind::kAllGather, ring ? 0 : KV, "forward K/V all-gather");
  expect_layer(f1, f2, CommOpKind::kSendRecv, ring ? KV : 0, "forward K/V ring");
  expect_layer(f1, f2, CommOpKind::kReduceScatter, 0, "forward reduce-scatter");
  expect_layer(f1, f2, CommOpKind::kAllReduce, 0, "forward all-reduce");
  EXPECT_EQ(f2.total().bytes_sent - f1.total().bytes_sent, KV * 4) << "forward: nothing but K/V";
  // 2B all-gathers per layer (K and V, one per batch entry), or N-1 packed hops.
  EXPECT_EQ(layer_calls(f1, f2, CommOpKind::kAllGather), ring ? 0 : 2 * B);
  EXPECT_EQ(layer_calls(f1, f2, CommOpKind::kSendRecv), ring ? hops : 0);
  expect_all_reduce(f1, 1, false);
  expect_all_reduce(f2, 2, false);

  const CommStats b1 = run(1, o, true, B, S), b2 = run(2, o, true, B, S);
  expect_layer(b1, b2, CommOpKind::kAllGather, ring ? 0 : 2 * KV, "K/V all-gathers, forward and backward");
  expect_layer(b1, b2, CommOpKind::kReduceScatter, ring ? 0 : KV, "dK/dV reduce-scatter");
  expect_layer(b1, b2, CommOpKind::kSendRecv, ring ? (recompute ? 4 : 3) * KV : 0, "K/V and dK/dV rings");
  expect_layer(b1, b2, CommOpKind::kBroadcast, 0, "broadcast");
  expect_layer(b1, b2, CommOpKind::kReduce, 0, "reduce");
  EXPECT_EQ(layer_calls(b1, b2, CommOpKind::kAllGather), ring ? 0 : 4 * B);
  EXPECT_EQ(layer_calls(b1, b2, CommOpKind::kReduceScatter), ring ? 0 : 2 * B);
  EXPECT_EQ(layer_calls(b1, b2, CommOpKind::kSendRecv), ring ? (recompute ? 4 : 3) * hops : 0);
  // The gradients of the replicated weights: one all-reduce of all of them per step.
  expect_all_reduce(b1, 1, true);
  expect_all_reduce(b2, 2, true);
}

INSTANTIATE_TEST_SUITE_P(
    Policies, SpTraffic,
    ::testing::Values(Policy{"allgather", Exchange::kAllGather, true, Recompute::kNone, SeqSplit::kZigzag},
                      Policy{"allgather_no_overlap_contiguous", Exchange::kAllGather, false, Recompute::kNone,
                             SeqSplit::kContiguous},
                      Policy{"allgather_recompute", Exchange::kAllGather, true, Recompute::kBlock, SeqSplit::kZigzag},
                      Policy{"ring", Exchange::kRing, true, Recompute::kNone, SeqSplit::kZigzag},
                      Policy{"ring_no_overlap_contiguous", Exchange::kRing, false, Recompute::kNone,
                             SeqSplit::kContiguous},
                      Policy{"ring_recompute", Exchange::kRing, true, Recompute::kBlock, SeqSplit::kZigzag}),
    [](const ::testing::TestParamInfo<Policy>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace foldpar
