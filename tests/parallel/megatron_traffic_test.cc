// Megatron traffic (tp=T, sp=S_, tp=T,sp=S_): what each rank counts (comm/comm_stats.h
// convention) on the tp and on the sp communicator SEPARATELY, per operation kind (calls,
// bytes sent, bytes received), equals the formulas written in
// parallel/megatron/megatron_model.h, which this file computes again from the config. An
// axis of one rank, or one the layout lacks, moves nothing and is called nothing. Notation:
// T, S_ the degrees, N = B*S/S_ the sp shard's token rows, n = N*h, G(x) = x (T-1)/T,
// KV = 2*B*S*h/(g T) * (S_-1)/S_. Per layer per rank, in elements:
//   forward   tp: all_reduce 4 G(n) (2 calls) | sequence parallel: all_gather 2 G(n) +
//             reduce_scatter 2 G(n) (2 calls each) -- docs/tsp.md section 7's 4 B (S/S_) h (T-1)/T
//             sp: all_gather KV (2B calls) | ring: send_recv KV (S_-1 hops) -- spec's
//             2 B S h/(g T) (S_-1)/S_
//   backward  tp: plain all_reduce 4 G(n) (2 calls) | sequence parallel: all_gather 4 G(n)
//   (fb - f)  (4 calls; 2 with recompute, which keeps the rerun's gathered norm outputs) +
//             reduce_scatter 2 G(n) (2 calls), and 2h more in the step's norm all_reduce;
//             recompute adds one layer's forward
//             sp: all_gather KV (2B calls) + reduce_scatter KV (2B calls) | ring: send_recv
//             2 KV (2(S_-1) hops), 3 KV with recompute; and attn + mlp shard elements + 2h
//             more in the step's gradient all_reduce
// One layer is the difference between a 2-layer and a 1-layer model; a whole step (L = 1, 2)
// equals the sum of every term, including the embedding, the loss and the per-step gradient
// all_reduce over sp. All-reduces are held to the ring-block rule (2n - b[p] - b[next] sent,
// 2n - b[prev] - b[p] received) for this rank. The policies of each layout family are those
// the tp=T, sp=S_ and tp x sp suites held before the three became one strategy, on the same
// sizes (tp=T: S = 12 T, n_kv 6 at T = 3; sp=S_: S = 12 S_; the 2-D meshes: S = 48).
#include <gtest/gtest.h>

#include <map>

#include "app/synthetic.h"
#include "comm/comm_stats.h"
#include "comm/mesh.h"
#include "megatron_layouts.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"

namespace foldpar {
namespace {

using Exchange = Layout::KvExchange;

using test::Family;

// The layouts a policy runs on: those of the family it was written for.
std::vector<std::string> layouts(Family f) { return test::megatron_layouts(f); }

// variants: 0 none; 1 qwen3 with attention_bias (every attention variant at once); 2 Llama's
// mlp_bias alone.
LlamaConfig traffic_config(int layers, bool tied, int kv_heads, int variants = 0) {
  LlamaConfig c;
  c.qkv_bias = c.o_bias = c.qk_norm = variants == 1;
  c.mlp_bias = variants == 2;
  c.hidden_size = 96;
  c.num_attention_heads = 12;
  c.num_key_value_heads = kv_heads;  // 4: g = 3, two KV heads per rank at T = 2; 6 at T = 3
  c.intermediate_size = 144;
  c.vocab_size = 120;
  c.num_hidden_layers = layers;
  c.max_position_embeddings = 512;
  c.tie_word_embeddings = tied;
  return c;
}

constexpr int64_t kBatch = 2;


struct Policy {
  const char* name;
  Family family;
  Exchange exchange;
  bool sequence_parallel;
  Recompute recompute;
  bool overlap;
  SeqSplit split;
  bool tied;
};

void PrintTo(const Policy& p, std::ostream* os) { *os << p.name; }

// The sizes of a layout: S and the KV heads.
struct Sizes {
  int T, P;
  int64_t seq;
  int kv_heads;
};

Sizes sizes(const Mesh& mesh, Family f) {
  const int T = mesh.degree("tp"), P = mesh.degree("sp");
  switch (f) {
    case Family::kTp: return {T, P, 12 * T, T == 3 ? 6 : 4};
    case Family::kSp: return {T, P, 12 * P, 4};
    case Family::kMesh: return {T, P, 48, 4};
  }
  return {T, P, 48, 4};
}

struct Counted {
  CommStats tp, sp;
};

// One step's counters on each axis the mesh has (nothing on an axis it lacks).
// kv_heads > 0 replaces the sizes' KV heads.
Counted run(const std::string& layout, int layers, const Policy& pol, bool backward, int variants = 0,
            int kv_heads = 0) {
  Result<Mesh> mesh = Mesh::create(test::mpi().world(), layout);
  FP_CHECK_OK(mesh.status());
  const Sizes z = sizes(*mesh, pol.family);
  const LlamaConfig c = traffic_config(layers, pol.tied, kv_heads > 0 ? kv_heads : z.kv_heads, variants);
  const Layout o = test::megatron_layout_with(layout, pol);
  Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(c, *mesh, z.seq, o);
  FP_CHECK_OK(m.status());
  ShardedModel& model = **m;
  model.init_weights(InitOptions{.seed = 1});
  const Batch local = model.local_batch(synthetic_batch(c, kBatch, z.seq, 3));
  auto be = make_cpu_backend();
  std::vector<const Communicator*> axes;
  for (const char* axis : {"tp", "sp"})
    if (mesh->has_axis(axis)) axes.push_back(&mesh->comm(axis));
  ScopedCommCounter counter(axes);
  Result<StepResult> r = backward ? model.forward_backward(*be, local, 0) : model.forward(*be, local);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  Counted out;
  if (mesh->has_axis("tp")) out.tp = counter.delta(mesh->comm("tp"));
  if (mesh->has_axis("sp")) out.sp = counter.delta(mesh->comm("sp"));
  return out;
}

// Expected counters per kind, in bytes.
struct Expected {
  std::map<CommOpKind, OpCounters> ops;
  // A symmetric term (every kind but all_reduce): elements each sent and received.
  void add(CommOpKind kind, uint64_t calls, uint64_t elements, uint64_t bytes_per = 4) {
    OpCounters& o = ops[kind];
    o.calls += calls;
    o.bytes_sent += elements * bytes_per;
    o.bytes_received += elements * bytes_per;
  }
  // An all_reduce of n elements over N ranks, for rank p: the ring-block rule.
  void add_all_reduce(uint64_t calls, uint64_t n, int N, int p, uint64_t bytes_per = 4) {
    OpCounters& o = ops[CommOpKind::kAllReduce];
    o.calls += calls;
    if (N == 1) return;
    auto block = [&](int i) { return n / N + (static_cast<uint64_t>(i) < n % N ? 1 : 0); };
    const int next = (p + 1) % N, prev = (p - 1 + N) % N;
    o.bytes_sent += (2 * n - block(p) - block(next)) * bytes_per;
    o.bytes_received += (2 * n - block(prev) - block(p)) * bytes_per;
  }
  // The growth of one all_reduce from n1 to n2 elements (no extra call).
  void add_all_reduce_growth(uint64_t n1, uint64_t n2, int N, int p) {
    Expected a, b;
    a.add_all_reduce(0, n1, N, p);
    b.add_all_reduce(0, n2, N, p);
    OpCounters& o = ops[CommOpKind::kAllReduce];
    o.bytes_sent += b.ops[CommOpKind::kAllReduce].bytes_sent - a.ops[CommOpKind::kAllReduce].bytes_sent;
    o.bytes_received += b.ops[CommOpKind::kAllReduce].bytes_received - a.ops[CommOpKind::kAllReduce].bytes_received;
  }
  void add_times(const Expected& x, uint64_t times) {
    for (const auto& [kind, v] : x.ops) {
      OpCounters& o = ops[kind];
      o.calls += v.calls * times;
      o.bytes_sent += v.bytes_sent * times;
      o.bytes_received += v.bytes_received * times;
    }
  }
};

// Every kind: the expected calls and bytes, 0 for kinds not listed.
void expect_counters(const CommStats& got, const Expected& want, const std::string& what) {
  for (int i = 0; i < kNumCommOpKinds; ++i) {
    const CommOpKind kind = static_cast<CommOpKind>(i);
    const auto it = want.ops.find(kind);
    const OpCounters w = it == want.ops.end() ? OpCounters{} : it->second;
    const OpCounters& o = got.op(kind);
    EXPECT_EQ(o.calls, w.calls) << what << ": " << comm_op_name(kind) << " calls";
    EXPECT_EQ(o.bytes_sent, w.bytes_sent) << what << ": " << comm_op_name(kind) << " bytes sent";
    EXPECT_EQ(o.bytes_received, w.bytes_received) << what << ": " << comm_op_name(kind) << " bytes received";
  }
}

// The formulas of parallel/megatron/megatron_model.h, from the config and the mesh. An axis
// of one rank issues nothing: its terms are empty.
struct Formulas {
  int T, t, P, p;
  bool seq_par, ring, recompute, tied;
  uint64_t B, S, h, g, N, n, KV;
  uint64_t layer_shard_elems, vocab_elems;

  uint64_t G(uint64_t x) const { return x * static_cast<uint64_t>(T - 1) / static_cast<uint64_t>(T); }
  uint64_t norm_elems(uint64_t L) const { return (2 * L + 1) * h; }
  uint64_t grad_elems(uint64_t L) const {
    return L * layer_shard_elems + (tied ? 1 : 2) * vocab_elems + norm_elems(L);
  }

  Expected tp_layer_forward() const {
    Expected e;
    if (T == 1) return e;
    if (seq_par) {
      e.add(CommOpKind::kAllGather, 2, 2 * G(n));      // f' before Q/K/V and gate/up
      e.add(CommOpKind::kReduceScatter, 2, 2 * G(n));  // g' after Wo and Wdown
    } else {
      e.add_all_reduce(2, n, T, t);  // g after Wo and after Wdown
      e.add_all_reduce(0, n, T, t);
    }
    return e;
  }
  Expected tp_layer_backward() const {
    Expected e;
    if (T == 1) return e;
    if (recompute) e = tp_layer_forward();  // the rerun
    if (seq_par) {
      e.add(CommOpKind::kAllGather, 2, 2 * G(n));                  // dY of both sub-blocks (g'^T)
      if (!recompute) e.add(CommOpKind::kAllGather, 2, 2 * G(n));  // norm outputs gathered again
      e.add(CommOpKind::kReduceScatter, 2, 2 * G(n));              // dX of the column-parallel GEMMs (f'^T)
      e.add_all_reduce_growth(norm_elems(1), norm_elems(2), T, t);  // two gains more in the norm all_reduce
    } else {
      e.add_all_reduce(2, n, T, t);  // dX of both column-parallel GEMMs (f^T)
      e.add_all_reduce(0, n, T, t);
    }
    return e;
  }
  Expected sp_layer_forward() const {
    Expected e;
    if (P == 1) return e;
    if (ring) {
      e.add(CommOpKind::kSendRecv, static_cast<uint64_t>(P - 1), KV);
    } else {
      e.add(CommOpKind::kAllGather, 2 * B, KV);  // K and V, one per batch entry
    }
    return e;
  }
  Expected sp_layer_backward() const {
    Expected e;
    if (P == 1) return e;
    if (ring) {
      const uint64_t rings = recompute ? 3 : 2;  // (the rerun's,) K/V again, dK/dV home
      e.add(CommOpKind::kSendRecv, rings * static_cast<uint64_t>(P - 1), rings * KV);
    } else {
      e.add(CommOpKind::kAllGather, 2 * B, KV);      // again (or the rerun's, kept for backward)
      e.add(CommOpKind::kReduceScatter, 2 * B, KV);  // dK, dV
    }
    e.add_all_reduce_growth(grad_elems(1), grad_elems(2), P, p);
    return e;
  }

  Expected tp_step(uint64_t L, bool backward) const {
    Expected e;
    if (T == 1) return e;
    e.add_times(tp_layer_forward(), L);
    e.add_all_reduce(1, N, T, t);      // loss: row maxima
    e.add_all_reduce(1, 2 * N, T, t);  // loss: sums of exponentials and target logits
    if (seq_par) {
      e.add(CommOpKind::kAllGather, 1, G(2 * N));  // ids and targets (i32)
      e.add(CommOpKind::kReduceScatter, 1, G(n));  // embedding (g')
      e.add(CommOpKind::kAllGather, 1, G(n));      // xf before the LM head (f')
    } else {
      e.add_all_reduce(1, n, T, t);  // embedding (g)
    }
    if (!backward) return e;
    Expected layer = tp_layer_backward();
    if (seq_par) {
      // The per-layer growth of the norm all_reduce is counted by the whole-step term below.
      layer.ops[CommOpKind::kAllReduce] = OpCounters{};
      e.add(CommOpKind::kReduceScatter, 1, G(n));  // d_xf (f'^T)
      e.add(CommOpKind::kAllGather, 1, G(n));      // embedding dX (g'^T)
      e.add_all_reduce(1, norm_elems(L), T, t);    // every norm gain's partial, packed
    } else {
      e.add_all_reduce(1, n, T, t);  // d_xf (f^T)
    }
    e.add_times(layer, L);
    return e;
  }
  Expected sp_step(uint64_t L, bool backward) const {
    Expected e;
    if (P == 1) return e;
    e.add_times(sp_layer_forward(), L);
    e.add_all_reduce(1, 2, P, p, 8);  // loss sum and valid count, f64
    if (!backward) return e;
    Expected layer = sp_layer_backward();
    layer.ops[CommOpKind::kAllReduce] = OpCounters{};  // counted whole below
    e.add_times(layer, L);
    e.add_all_reduce(1, grad_elems(L), P, p);  // every gradient this rank holds, packed
    return e;
  }
};

Formulas formulas(const std::string& layout, const Policy& pol) {
  Result<Mesh> mesh = Mesh::create(test::mpi().world(), layout);
  FP_CHECK_OK(mesh.status());
  const Sizes z = sizes(*mesh, pol.family);
  const LlamaConfig c = traffic_config(1, pol.tied, z.kv_heads);
  Formulas F{};
  F.T = mesh->degree("tp");
  F.t = mesh->coord("tp");
  F.P = mesh->degree("sp");
  F.p = mesh->coord("sp");
  F.seq_par = pol.sequence_parallel && F.T > 1;  // sequence parallelism of one tp rank changes nothing
  F.ring = pol.exchange == Exchange::kRing;
  F.recompute = pol.recompute == Recompute::kBlock;
  F.tied = pol.tied;
  F.B = kBatch;
  F.S = static_cast<uint64_t>(z.seq);
  F.h = static_cast<uint64_t>(c.hidden_size);
  F.g = static_cast<uint64_t>(c.group());
  F.N = F.B * F.S / F.P;
  F.n = F.N * F.h;
  F.KV = 2 * F.B * F.S * F.h / (F.g * F.T) * (F.P - 1) / F.P;  // docs/tsp.md section 7, the TP x SP row
  const uint64_t T = F.T, f = c.intermediate_size, kv = c.kv_dim();
  F.layer_shard_elems = (2 * F.h * F.h + 2 * F.h * kv) / T + 3 * F.h * f / T;
  F.vocab_elems = c.vocab_size / T * F.h;
  return F;
}

class MegatronTraffic : public ::testing::TestWithParam<Policy> {
 protected:
  void SetUp() override {
    if (layouts(GetParam().family).empty()) GTEST_SKIP() << "the 2-D meshes are listed for 1, 2 and 4 ranks";
  }
};

TEST_P(MegatronTraffic, OneLayerEqualsTheFormulasOnEachCommunicator) {
  const Policy pol = GetParam();
  for (const std::string& layout : layouts(pol.family)) {
    SCOPED_TRACE(layout);
    const Formulas F = formulas(layout, pol);
    const Counted f1 = run(layout, 1, pol, false), f2 = run(layout, 2, pol, false);
    const CommStats tp_f = f2.tp - f1.tp, sp_f = f2.sp - f1.sp;
    expect_counters(tp_f, F.tp_layer_forward(), "tp, one layer forward");
    expect_counters(sp_f, F.sp_layer_forward(), "sp, one layer forward");
    // Spec section 7's rows (TP, SP, TP x SP), written from the config alone.
    const uint64_t B = kBatch, S = F.S, h = F.h, g = F.g, T = F.T, P = F.P;
    EXPECT_EQ(tp_f.total().bytes_received, 4 * (4 * B * (S / P) * h * (T - 1) / T)) << "tp: 4 B (S/S_) h (T-1)/T";
    EXPECT_EQ(sp_f.total().bytes_received, 4 * (2 * B * S * h / (g * T) * (P - 1) / P))
        << "sp: 2 B S h/(g T) (S_-1)/S_";
    EXPECT_EQ(sp_f.total().bytes_sent, sp_f.total().bytes_received) << "sp forward: nothing but K/V";

    const Counted b1 = run(layout, 1, pol, true), b2 = run(layout, 2, pol, true);
    expect_counters((b2.tp - b1.tp) - tp_f, F.tp_layer_backward(), "tp, one layer backward");
    expect_counters((b2.sp - b1.sp) - sp_f, F.sp_layer_backward(), "sp, one layer backward");
  }
}

TEST_P(MegatronTraffic, WholeStepEqualsTheSumOfItsTerms) {
  const Policy pol = GetParam();
  for (const std::string& layout : layouts(pol.family)) {
    SCOPED_TRACE(layout);
    const Formulas F = formulas(layout, pol);
    for (int layers : {1, 2}) {
      const std::string L = ", L=" + std::to_string(layers);
      const Counted f = run(layout, layers, pol, false), fb = run(layout, layers, pol, true);
      expect_counters(f.tp, F.tp_step(layers, false), "tp, forward" + L);
      expect_counters(f.sp, F.sp_step(layers, false), "sp, forward" + L);
      expect_counters(fb.tp, F.tp_step(layers, true), "tp, forward+backward" + L);
      expect_counters(fb.sp, F.sp_step(layers, true), "sp, forward+backward" + L);
    }
  }
}

// The attention variants (q/k/v and o biases, q/k norms; replicated) against the plain model
// on the same layout: the forward moves the same; the backward adds one all_reduce over tp of
// the q/k/v bias and q/k norm partials, L (n_h d + 2 n_kv d + 2d) elements (the o bias needs
// none: every tp rank holds every row's dy), and their L (n_h d + 2 n_kv d + h + 2d) gradient
// elements grow the step's gradient all_reduce over sp.
class MegatronTrafficVariants : public MegatronTraffic {};

TEST_P(MegatronTrafficVariants, AddOneTpAllReduceAndGrowTheSpGradientSum) {
  const Policy pol = GetParam();
  for (const std::string& layout : layouts(pol.family)) {
    SCOPED_TRACE(layout);
    const Formulas F = formulas(layout, pol);
    const Sizes z = sizes(Mesh::create(test::mpi().world(), layout).value(), pol.family);
    const LlamaConfig c = traffic_config(1, pol.tied, z.kv_heads, true);
    const uint64_t qkv = static_cast<uint64_t>(c.q_dim() + 2 * c.kv_dim()), d = static_cast<uint64_t>(c.head_dim());
    for (bool backward : {false, true}) {
      const std::string what = backward ? "forward+backward" : "forward";
      const Counted plain = run(layout, 1, pol, backward), variants = run(layout, 1, pol, backward, true);
      Expected tp, sp;
      if (backward && F.T > 1) tp.add_all_reduce(1, qkv + 2 * d, F.T, F.t);
      if (backward && F.P > 1) sp.add_all_reduce_growth(F.grad_elems(1), F.grad_elems(1) + qkv + F.h + 2 * d, F.P, F.p);
      expect_counters(variants.tp - plain.tp, tp, "tp, " + what);
      expect_counters(variants.sp - plain.sp, sp, "sp, " + what);
    }
  }
}

// Llama's mlp_bias against the plain model: the forward moves the same; the backward adds one
// all_reduce over tp of the gate/up bias partials, L 2f elements (the down bias, like the o
// bias, needs none), and their L (2f + h) gradient elements grow the gradient sum over sp.
TEST_P(MegatronTrafficVariants, MlpBiasAddsOneTpAllReduceAndGrowsTheSpGradientSum) {
  const Policy pol = GetParam();
  for (const std::string& layout : layouts(pol.family)) {
    SCOPED_TRACE(layout);
    const Formulas F = formulas(layout, pol);
    const Sizes z = sizes(Mesh::create(test::mpi().world(), layout).value(), pol.family);
    const LlamaConfig c = traffic_config(1, pol.tied, z.kv_heads, 2);
    const uint64_t f2 = 2 * static_cast<uint64_t>(c.intermediate_size);
    for (bool backward : {false, true}) {
      const std::string what = backward ? "forward+backward" : "forward";
      const Counted plain = run(layout, 1, pol, backward), biased = run(layout, 1, pol, backward, 2);
      Expected tp, sp;
      if (backward && F.T > 1) tp.add_all_reduce(1, f2, F.T, F.t);
      if (backward && F.P > 1) sp.add_all_reduce_growth(F.grad_elems(1), F.grad_elems(1) + f2 + F.h, F.P, F.p);
      expect_counters(biased.tp - plain.tp, tp, "tp, " + what);
      expect_counters(biased.sp - plain.sp, sp, "sp, " + what);
    }
  }
}

constexpr Exchange kGather = Exchange::kAllGather, kRing = Exchange::kRing;
constexpr Recompute kKeep = Recompute::kNone, kRerun = Recompute::kBlock;
constexpr SeqSplit kZigzag = SeqSplit::kZigzag, kContiguous = SeqSplit::kContiguous;

INSTANTIATE_TEST_SUITE_P(
    Policies, MegatronTraffic,
    ::testing::Values(
        // tp=T: plain and sequence-parallel norms, recompute, overlap off.
        Policy{"tp_plain", Family::kTp, kGather, false, kKeep, true, kZigzag, false},
        Policy{"tp_plain_recompute", Family::kTp, kGather, false, kRerun, true, kZigzag, false},
        Policy{"tp_plain_no_overlap", Family::kTp, kGather, false, kKeep, false, kZigzag, false},
        Policy{"tp_seqpar", Family::kTp, kGather, true, kKeep, true, kZigzag, false},
        Policy{"tp_seqpar_recompute_no_overlap", Family::kTp, kGather, true, kRerun, false, kZigzag, false},
        Policy{"tp_seqpar_no_overlap", Family::kTp, kGather, true, kKeep, false, kZigzag, false},
        // sp=S_: both exchanges, both splits, overlap off, recompute.
        Policy{"sp_allgather", Family::kSp, kGather, false, kKeep, true, kZigzag, false},
        Policy{"sp_allgather_no_overlap_contiguous", Family::kSp, kGather, false, kKeep, false, kContiguous, false},
        Policy{"sp_allgather_recompute", Family::kSp, kGather, false, kRerun, true, kZigzag, false},
        Policy{"sp_ring", Family::kSp, kRing, false, kKeep, true, kZigzag, false},
        Policy{"sp_ring_no_overlap_contiguous", Family::kSp, kRing, false, kKeep, false, kContiguous, false},
        Policy{"sp_ring_recompute", Family::kSp, kRing, false, kRerun, true, kZigzag, false},
        // tp=T,sp=S_.
        Policy{"mesh_allgather", Family::kMesh, kGather, false, kKeep, true, kZigzag, false},
        Policy{"mesh_ring_tied", Family::kMesh, kRing, false, kKeep, true, kZigzag, true},
        Policy{"mesh_allgather_recompute", Family::kMesh, kGather, false, kRerun, true, kZigzag, false},
        Policy{"mesh_ring_recompute_no_overlap_contiguous", Family::kMesh, kRing, false, kRerun, false, kContiguous,
               false},
        Policy{"mesh_seqpar_allgather", Family::kMesh, kGather, true, kKeep, true, kZigzag, false},
        Policy{"mesh_seqpar_allgather_recompute_no_overlap", Family::kMesh, kGather, true, kRerun, false, kZigzag,
               true},
        Policy{"mesh_seqpar_ring_recompute", Family::kMesh, kRing, true, kRerun, true, kZigzag, false}),
    [](const ::testing::TestParamInfo<Policy>& i) { return std::string(i.param.name); });

INSTANTIATE_TEST_SUITE_P(
    Variants, MegatronTrafficVariants,
    ::testing::Values(Policy{"tp_plain", Family::kTp, kGather, false, kKeep, true, kZigzag, false},
                      Policy{"tp_seqpar", Family::kTp, kGather, true, kKeep, true, kZigzag, false},
                      Policy{"sp_ring", Family::kSp, kRing, false, kKeep, true, kZigzag, false},
                      Policy{"mesh_seqpar_allgather", Family::kMesh, kGather, true, kKeep, true, kZigzag, false}),
    [](const ::testing::TestParamInfo<Policy>& i) { return std::string(i.param.name); });

// KV replicas (n_kv < T, docs/tsp.md section 3): against n_kv = T (one KV head per rank, the
// same shapes), every collective moves the same bytes; per layer the group's Wk/Wv gradient
// partials (2 d h f32 each) are summed point to point: the group's first rank receives T-1 of
// them and sends T-1 sums back, every other rank sends one and receives one.
TEST(MegatronTrafficKvReplicas, CollectivesUnchangedAndOneGroupSumPerLayer) {
  const int T = test::mpi().world().size(), p = test::mpi().world().rank();
  if (T == 1) GTEST_SKIP() << "no replicas on one rank";
  const std::string layout = "tp=" + std::to_string(T);
  const Policy pol{"tp_plain", Family::kTp, Exchange::kAllGather, false, Recompute::kNone, true, SeqSplit::kZigzag,
                   false};
  const int L = 2;
  const uint64_t rows = 2 * 8 * 96 * 4;  // 2 d h f32: d = 96 / 12
  const CommStats base = run(layout, L, pol, true, false, T).tp, rep = run(layout, L, pol, true, false, 1).tp;
  for (CommOpKind kind : {CommOpKind::kBroadcast, CommOpKind::kReduce, CommOpKind::kAllReduce, CommOpKind::kAllGather,
                          CommOpKind::kReduceScatter, CommOpKind::kAllToAll, CommOpKind::kSendRecv}) {
    EXPECT_EQ(rep.op(kind).calls, base.op(kind).calls) << comm_op_name(kind);
    EXPECT_EQ(rep.op(kind).bytes_sent, base.op(kind).bytes_sent) << comm_op_name(kind);
    EXPECT_EQ(rep.op(kind).bytes_received, base.op(kind).bytes_received) << comm_op_name(kind);
  }
  const uint64_t peers = p == 0 ? static_cast<uint64_t>(T - 1) : 1;
  EXPECT_EQ(base.op(CommOpKind::kSend).calls + base.op(CommOpKind::kRecv).calls, 0u);
  for (CommOpKind kind : {CommOpKind::kSend, CommOpKind::kRecv}) {
    EXPECT_EQ(rep.op(kind).calls, L * peers) << comm_op_name(kind);
    EXPECT_EQ(kind == CommOpKind::kSend ? rep.op(kind).bytes_sent : rep.op(kind).bytes_received, L * peers * rows)
        << comm_op_name(kind);
  }
  const CommStats fwd = run(layout, L, pol, false, false, 1).tp;
  EXPECT_EQ(fwd.op(CommOpKind::kSend).calls + fwd.op(CommOpKind::kRecv).calls, 0u) << "forward";
}

}  // namespace
}  // namespace foldpar
