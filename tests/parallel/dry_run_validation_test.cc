// The dry run (plan/dry_run.h) against a real run of the same code: for each layout at this
// many ranks, every rank's dry run as that rank gives exactly the tracked peak (total and
// per category) of the real step and exactly the calls and bytes each axis communicator
// counts, for training and forward-only steps (f32 and bf16 storage), and for generation's
// prefill and decode. Layouts whose strategy still touches tensor
// data on the host cannot dry-run yet and skip, naming the access
// (tests/unit/dry_run_test.cc finds them).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "app/synthetic.h"
#include "backend/bf16_storage_backend.h"
#include "backend/meta/meta_backend.h"
#include "backend/timed_backend.h"
#include "comm/counting_communicator.h"
#include "comm/mesh.h"
#include "comm/self_communicator.h"
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
  std::array<int64_t, kNumMemCategories> before_call{};  // generation: currents just before the call
};

// One real step of `lo` on this rank, measured as the dry run measures it.
// `backend`: the CPU backend (under the bf16 storage decorator for bf16 layouts). micro > 0:
// the trainer's micro-batches of that many sequences (a pipeline's schedule).
Measured measure(const Layout& lo, int64_t B, int64_t S, DryRunMode mode, Backend& backend, int64_t micro = 0,
                 const LlamaConfig& config = validation_config(), Communicator* one_rank = nullptr) {
  Communicator& world = one_rank != nullptr ? *one_rank : test::mpi().world();
  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  FP_CHECK_OK(mesh.status());
  const int64_t rows = B / lo.dp, n_micro = micro > 0 ? rows / micro : 1;
  std::vector<Batch> globals;
  for (int64_t a = 0; a < n_micro; ++a) globals.push_back(synthetic_batch(config, rows / n_micro, S, 3 + a));
  MemoryTracker& mt = MemoryTracker::process();
  mt.release_cache();
  Measured out;
  const MemoryStats before = mt.stats();
  out.base = before.current;
  out.base_total = before.current_total;
  {
    Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(config, *mesh, S, lo);
    FP_CHECK_OK(m.status());
    (*m)->init_weights(InitOptions{.seed = 1});
    std::vector<Batch> locals;
    for (const Batch& global : globals) {
      locals.push_back((*m)->local_batch(global));
      const Batch& local = locals.back();
      if (local.input_ids.shares_storage_with(global.input_ids))
        out.aliased_batch_bytes += static_cast<int64_t>(local.input_ids.nbytes() + local.target_ids.nbytes());
    }
    std::unique_ptr<Backend> bf16 = lo.dtype == DType::kBF16 ? make_bf16_storage_backend(backend) : nullptr;
    Backend* be = bf16 ? bf16.get() : &backend;
    mt.reset_peaks();
    // The mesh's axes, then those the model split off the world (a MoE model's expert groups),
    // which the dry run lists after them in the order of their first operation.
    std::vector<const Communicator*> comms = mesh->communicators();
    const std::vector<const Communicator*> beside = (*m)->communicators_beside_mesh();
    comms.insert(comms.end(), beside.begin(), beside.end());
    ScopedCommCounter counter(comms);
    if (mode == DryRunMode::kForwardBackward && locals.size() > 1) {
      FP_CHECK_OK((*m)->forward_backward_micro_batches(*be, locals, B * S).status());
    } else if (mode == DryRunMode::kForwardBackward) {
      // MoE: the step's own valid count (the dry run's; the synthetic batch ignores a few
      // targets, which changes no shape).
      FP_CHECK_OK((*m)->forward_backward(*be, locals.front(), config.moe.enabled() ? 0 : B * S).status());
    } else {
      FP_CHECK_OK((*m)->forward(*be, locals.front()).status());
    }
    out.step = mt.stats();
    for (const Communicator* c : mesh->communicators()) out.axes.emplace_back(c->name(), counter.delta(*c));
    for (const Communicator* c : beside)
      if (counter.delta(*c).total().calls > 0) out.axes.emplace_back(c->name(), counter.delta(*c));
  }
  return out;
}

// Each axis's counters of the dry run equal the real step's, axis by axis.
void expect_same_traffic(const DryRunResult& dry, const Measured& real, const std::string& what) {
  ASSERT_EQ(dry.comm.size(), real.axes.size());
  for (size_t i = 0; i < real.axes.size(); ++i) {
    EXPECT_EQ(dry.comm[i].first, real.axes[i].first);
    EXPECT_EQ(dry.comm[i].second, real.axes[i].second)
        << what << " axis " << real.axes[i].first << "\ndry:\n"
        << dry.comm[i].second.to_string() << "real:\n" << real.axes[i].second.to_string();
  }
}

// A training-side step: the peak (total and per category, from the real base; an aliased
// batch counted as the dry run counts it) and the traffic.
void expect_same_step(const DryRunResult& dry, const Measured& real, const std::string& what) {
  EXPECT_EQ(dry.step.peak_total, real.step.peak_total - real.base_total + real.aliased_batch_bytes) << what;
  for (int k = 0; k < kNumMemCategories; ++k) {
    const int64_t alias = k == static_cast<int>(MemCategory::kActivations) ? real.aliased_batch_bytes : 0;
    EXPECT_EQ(dry.step.peak[k], real.step.peak[k] - real.base[k] + alias)
        << what << ": " << mem_category_name(static_cast<MemCategory>(k));
  }
  expect_same_traffic(dry, real, what);
}

struct Case {
  const char* layout;
  int ranks;
  DryRunMode mode;
  const char* host_access = nullptr;  // what still stops the dry run (the case skips)
  // bf16: the decorator widens matmul operands too (an inner backend without bf16 GEMMs),
  // whatever this CPU has.
  bool widen_matmul = false;
  int64_t micro = 0;  // sequences per micro-batch (0: one micro-batch of B / dp)
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
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  // TimedBackend answers matmul_takes_bf16 false (the Backend default): under it the
  // decorator widens GEMM operands as on a CPU without bf16 instructions.
  TimedBackend timed(*cpu);
  Backend& inner = c.widen_matmul ? static_cast<Backend&>(timed) : *cpu;
  if (c.widen_matmul && inner.matmul_takes_bf16()) GTEST_SKIP() << "no backend here that widens bf16 GEMM operands";
  const Measured real = measure(lo, B, S, c.mode, inner, c.micro);
  DryRunOptions o;
  o.config = validation_config();
  o.layout = lo;
  o.rank = world.rank();
  o.batch = B;
  o.seq = S;
  o.mode = c.mode;
  o.matmul_takes_bf16 = inner.matmul_takes_bf16();  // as the real step's backend answers
  o.micro_batch = c.micro;
  Result<DryRunResult> dry = dry_run(o);
  ASSERT_TRUE(dry.ok()) << dry.status().to_string();
  expect_same_step(*dry, real, fmt::format("{} rank {}", c.layout, world.rank()));
}

constexpr DryRunMode kFB = DryRunMode::kForwardBackward, kF = DryRunMode::kForward;
INSTANTIATE_TEST_SUITE_P(
    Layouts, DryRunValidation,
    testing::Values(Case{"tsp=2", 2, kFB}, Case{"tsp=2", 2, kF},
                    Case{"tsp=2:nooverlap", 2, kFB}, Case{"tp=2", 2, kFB},
                    Case{"tp=2:seqpar", 2, kFB}, Case{"sp=2", 2, kFB},
                    Case{"sp=2:ring", 2, kFB}, Case{"tsp=4", 4, kFB},
                    Case{"tp=2,sp=2", 4, kFB}, Case{"dp=2,tsp=2", 4, kFB},
                    Case{"tsp=2:bf16", 2, kFB}, Case{"tsp=2:bf16", 2, kF},
                    Case{"tsp=2:bf16:recompute", 2, kFB}, Case{"tsp=4:bf16", 4, kFB},
                    Case{"dp=2,tsp=2:bf16", 4, kFB}, Case{"tsp=2:bf16", 2, kFB, nullptr, true},
                    Case{"tsp=4:bf16", 4, kF, nullptr, true},
                    // Each policy and degenerate mesh the replays' validation used to hold.
                    Case{"tsp=2:keepw:keepkv", 2, kFB}, Case{"tsp=2:recompute", 2, kFB},
                    Case{"tsp=2:buckets=2:nooverlap", 2, kFB}, Case{"tp=2:recompute", 2, kFB},
                    Case{"tp=2", 2, kF}, Case{"sp=2:recompute", 2, kFB}, Case{"sp=2:ring", 2, kF},
                    Case{"tp=2,sp=1", 2, kFB}, Case{"tp=1,sp=2:ring", 2, kFB}, Case{"tp=2,sp=1:seqpar", 2, kFB},
                    Case{"tsp=4:recompute", 4, kFB}, Case{"tp=2,sp=2:ring:seqpar", 4, kFB}, Case{"tp=4", 4, kFB},
                    Case{"sp=4:ring", 4, kFB}, Case{"tp=2,sp=2", 4, kF}, Case{"dp=2,tp=2:seqpar", 4, kFB},
                    // Pipelines: each stage's rank (a heavier and a lighter one), two micro-batches
                    // through 1F1B; and micro-batches without a pipeline (gradient accumulation).
                    Case{"pp=2,tsp=1", 2, kFB, nullptr, false, 1}, Case{"pp=2,tsp=2", 4, kFB, nullptr, false, 1},
                    Case{"pp=2,tp=2", 4, kFB, nullptr, false, 1}, Case{"dp=2,pp=2,tsp=1", 4, kFB, nullptr, false, 1},
                    // ZB-H1: the weight-gradient products queued in B and run as W.
                    Case{"pp=2,tsp=1:zb", 2, kFB, nullptr, false, 1}, Case{"pp=2,tp=2:zb", 4, kFB, nullptr, false, 1},
                    // ... and on tsp=2 stages with the reduces and the gradient ring behind them.
                    Case{"pp=2,tsp=2:zb", 4, kFB, nullptr, false, 1},
                    Case{"pp=2,tsp=2:zb:nooverlap:keepw", 4, kFB, nullptr, false, 1},
                    Case{"tsp=2", 2, kFB, nullptr, false, 1},
                    // bf16 storage under Megatron: bf16 rows, K/V and partials travel (2 bytes).
                    Case{"tp=2:bf16", 2, kFB}, Case{"tp=2:bf16", 2, kF}, Case{"tp=2:bf16:seqpar", 2, kFB},
                    Case{"tp=2:bf16:seqpar:recompute", 2, kFB}, Case{"sp=2:bf16", 2, kFB},
                    Case{"sp=2:bf16:ring", 2, kFB}, Case{"tp=2,sp=2:bf16:ring:seqpar", 4, kFB},
                    Case{"tp=2:bf16", 2, kFB, nullptr, true}, Case{"tp=2,sp=2:bf16:seqpar", 4, kFB},
                    Case{"tp=2,sp=2:bf16", 4, kF, nullptr, true}),
    [](const testing::TestParamInfo<Case>& i) {
      std::string n = std::string(i.param.layout) + (i.param.widen_matmul ? "_widened" : "") +
                      (i.param.mode == kF ? "_fwd" : "_train") + (i.param.micro > 0 ? "_micro" : "");
      for (char& ch : n)
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

// ---- MoE on the TSP axis (tsp_moe.cc) ----
//
// A dry run cannot route (no data): it assumes planned_moe_routing on every rank
// (backend/meta/meta_backend.h). The fair comparison is a real run on that same routing:
// ForcedRouting computes the real routing on the CPU backend, then overwrites the chosen
// experts with planned_moe_routing's, so the real step exchanges real counts, rows and
// expert ids over MPI, on the routing the plan assumed. Every shape after the routing is
// then the plan's (the dry run's counts come from its symmetric-rank delivery, the real
// run's from the wire), so peaks and counters must agree exactly, per scheme and rank.
class ForcedRouting final : public Backend {
 public:
  ForcedRouting(Backend& inner, double imbalance) : inner_(inner), imbalance_(imbalance) {}
  std::string_view name() const override { return inner_.name(); }
  bool matmul_takes_bf16() const override { return inner_.matmul_takes_bf16(); }
  bool tokenwise_takes_bf16() const override { return inner_.tokenwise_takes_bf16(); }
  void moe_route_forward(const Tensor& logits, bool normalize, Tensor& probs, Tensor& weights,
                         Tensor& experts) override {
    inner_.moe_route_forward(logits, normalize, probs, weights, experts);
    const std::vector<int32_t> planned = planned_moe_routing(experts.dim(0), experts.dim(1), logits.dim(1), imbalance_);
    inner_.copy_from_host(std::as_bytes(std::span<const int32_t>(planned)), experts);
    ++routed_;
  }
  int routed() const { return routed_; }
  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override { inner_.matmul(a, ta, b, tb, c, alpha, beta); }
  void copy(const Tensor& src, Tensor& dst) override { inner_.copy(src, dst); }
  void copy_strided(const Tensor& src, Tensor& dst, const StridedCopy& c) override { inner_.copy_strided(src, dst, c); }
  void copy_from_host(std::span<const std::byte> src, Tensor& dst) override { inner_.copy_from_host(src, dst); }
  void copy_to_host(const Tensor& src, std::span<std::byte> dst) override { inner_.copy_to_host(src, dst); }
  void add_inplace(const Tensor& x, Tensor& y) override { inner_.add_inplace(x, y); }
  void scale_inplace(double alpha, Tensor& y) override { inner_.scale_inplace(alpha, y); }
  void fill(double value, Tensor& y) override { inner_.fill(value, y); }
  double sum_squares(const Tensor& x) override { return inner_.sum_squares(x); }
  void adamw_update(const AdamWStep& s, const Tensor& grad, Tensor& param, Tensor& m, Tensor& v) override { inner_.adamw_update(s, grad, param, m, v); }
  void embedding_forward(const Tensor& ids, const Tensor& table, int64_t vocab_offset, Tensor& out) override { inner_.embedding_forward(ids, table, vocab_offset, out); }
  void embedding_backward(const Tensor& ids, const Tensor& d_out, int64_t vocab_offset, Tensor& d_table) override { inner_.embedding_backward(ids, d_out, vocab_offset, d_table); }
  void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) override { inner_.rmsnorm_forward(x, w, eps, y, rstd); }
  void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& dw) override { inner_.rmsnorm_backward(x, w, rstd, dy, dx, dw); }
  void rope_forward(const Tensor& table, Tensor& x) override { inner_.rope_forward(table, x); }
  void rope_backward(const Tensor& table, Tensor& dx) override { inner_.rope_backward(table, dx); }
  void attention_forward(const AttentionArgs& args, Tensor& out, Tensor& lse) override { inner_.attention_forward(args, out, lse); }
  void attention_backward(const AttentionArgs& args, const Tensor& out, const Tensor& lse, const Tensor& d_out, Tensor& dq, Tensor& dk, Tensor& dv) override { inner_.attention_backward(args, out, lse, d_out, dq, dk, dv); }
  void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& out) override { inner_.swiglu_forward(gate, up, out); }
  void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& d_out, Tensor& d_gate, Tensor& d_up) override { inner_.swiglu_backward(gate, up, d_out, d_gate, d_up); }
  double cross_entropy_forward(const Tensor& logits, const Tensor& targets, int32_t ignore_index, Tensor& lse) override { return inner_.cross_entropy_forward(logits, targets, ignore_index, lse); }
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t vocab_offset, int32_t ignore_index, double grad_scale, Tensor& d_logits) override { inner_.cross_entropy_backward(logits, targets, lse, vocab_offset, ignore_index, grad_scale, d_logits); }
  void softmax_chunk_update(const Tensor& logits, const Tensor& targets, int64_t vocab_offset, int32_t ignore_index, Tensor& row_max, Tensor& row_sum, Tensor& target_logit) override { inner_.softmax_chunk_update(logits, targets, vocab_offset, ignore_index, row_max, row_sum, target_logit); }
  void attention_merge(const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse) override { inner_.attention_merge(block_out, block_lse, out, lse); }
  void softmax_rescale(const Tensor& local_max, const Tensor& global_max, Tensor& row_sum) override { inner_.softmax_rescale(local_max, global_max, row_sum); }
  LossSums cross_entropy_finish(const Tensor& row_max, const Tensor& row_sum, const Tensor& target_logit, const Tensor& targets, int32_t ignore_index, Tensor& lse) override { return inner_.cross_entropy_finish(row_max, row_sum, target_logit, targets, ignore_index, lse); }
  int64_t count_valid_targets(const Tensor& targets, int32_t ignore_index) override { return inner_.count_valid_targets(targets, ignore_index); }
  void moe_route_backward(const MoeRouteGrad& g, Tensor& d_logits) override { inner_.moe_route_backward(g, d_logits); }
  void gather_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override { inner_.gather_rows(src, rows, scale, dst); }
  void scatter_add_rows(const Tensor& src, const Tensor& rows, const Tensor* scale, Tensor& dst) override { inner_.scatter_add_rows(src, rows, scale, dst); }
  void rows_dot(const Tensor& a, const Tensor& b, Tensor& out) override { inner_.rows_dot(a, b, out); }
  void sigmoid_forward(const Tensor& x, Tensor& y) override { inner_.sigmoid_forward(x, y); }
  void sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override { inner_.sigmoid_backward(y, dy, dx); }

 private:
  Backend& inner_;
  double imbalance_;
  int routed_ = 0;
};

LlamaConfig moe_validation_config() {
  LlamaConfig c = validation_config();
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.moe.family = MoeFamily::kMixtral;
  c.moe.num_experts = 4;
  c.moe.num_experts_per_tok = 2;
  c.moe.moe_intermediate_size = 96;
  c.moe.norm_topk_prob = true;
  c.moe.router_aux_loss_coef = 0.02;
  c.moe.output_router_logits = true;
  return c;
}

struct MoeCase {
  const char* layout;
  int ranks;
  DryRunMode mode;
  double imbalance = 1.0;
  int64_t experts = 4;  // E (k = min(2, E)); below the TSP degree each expert is split over D/E ranks
  // pp: sequences per micro-batch (0: one micro-batch of B / dp), the global batch, the layers.
  int64_t micro = 0;
  int64_t batch = 2;
  int64_t layers = 2;
};

class DryRunMoe : public testing::TestWithParam<MoeCase> {};

TEST_P(DryRunMoe, PeakAndTrafficEqualTheRealStepOnTheAssumedRouting) {
  const MoeCase c = GetParam();
  Communicator& world = test::mpi().world();
  // One rank (the single-rank model): each process runs it alone, on a communicator of its own.
  SelfCommunicator self("world", 0);
  if (c.ranks != 1 && world.size() != c.ranks) GTEST_SKIP() << c.layout << " runs at " << c.ranks << " ranks";
  const Layout lo = parse_layout(c.layout).value();
  LlamaConfig config = moe_validation_config();
  config.moe.num_experts = c.experts;
  config.moe.num_experts_per_tok = std::min<int64_t>(2, c.experts);
  config.num_hidden_layers = c.layers;
  const int64_t B = c.batch, S = 256;
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  ForcedRouting forced(*cpu, c.imbalance);
  const Measured real = measure(lo, B, S, c.mode, forced, c.micro, config, c.ranks == 1 ? &self : nullptr);
  // Under pp each stage routes its own sparse layers (every layer is sparse here, the stages
  // equal), once per micro-batch.
  const int64_t micro_batches = c.micro > 0 ? B / lo.dp / c.micro : 1;
  ASSERT_EQ(forced.routed(),
            static_cast<int>(config.moe.sparse_layer_count(config.num_hidden_layers) / lo.pp * micro_batches))
      << "the real step routed through the forced backend once per sparse layer of the stage and micro-batch";
  DryRunOptions o;
  o.config = config;
  o.layout = lo;
  o.rank = c.ranks == 1 ? 0 : world.rank();
  o.batch = B;
  o.seq = S;
  o.mode = c.mode;
  o.micro_batch = c.micro;
  o.moe_imbalance = c.imbalance;
  o.matmul_takes_bf16 = forced.matmul_takes_bf16();  // bf16 layouts: as the real step's backend answers
  Result<DryRunResult> dry = dry_run(o);
  ASSERT_TRUE(dry.ok()) << dry.status().to_string();
  const std::string what = fmt::format("{} imbalance {} rank {}", c.layout, c.imbalance, world.rank());
  expect_same_step(*dry, real, what);
}

// Negative control: the assumption reaches the traffic. Under expert 0 at 2x its share the
// all-to-all's single messages change size (rank 1 sends rank 0, expert 0's owner, more rows
// than balanced in one message; the dispatch and its return still move the same total), and
// rank 0's peak grows with the rows it receives.
TEST(DryRunMoe, TheAssumedRoutingChangesTheA2aMessagesAndPeak) {
  Communicator& world = test::mpi().world();
  if (world.size() != 2) GTEST_SKIP() << "runs at 2 ranks";
  struct Seen {
    uint64_t largest_send = 0;
    int64_t peak = 0;
  };
  auto seen = [](double imbalance, int rank) {
    DryRunOptions o;
    o.config = moe_validation_config();
    o.layout = parse_layout("tsp=2:moe=a2a").value();
    o.rank = rank;
    o.batch = 2;
    o.seq = 256;
    o.moe_imbalance = imbalance;
    Result<DryRunResult> dry = dry_run(o);
    FP_CHECK_OK(dry.status());
    Seen s;
    for (const CommEvent& e : dry->comm_trace.events)
      if (e.type == CommEvent::Type::kStart && e.kind == CommOpKind::kSend)
        s.largest_send = std::max(s.largest_send, e.bytes_sent);
    s.peak = dry->step.peak_total;
    return s;
  };
  const Seen balanced1 = seen(1.0, 1), skewed1 = seen(2.0, 1), balanced0 = seen(1.0, 0), skewed0 = seen(2.0, 0);
  const uint64_t row = 64 * 4;  // h f32
  EXPECT_EQ(balanced1.largest_send, 256 * row) << "balanced: T*k/D = 256*2/2 rows per message";
  EXPECT_GT(skewed1.largest_send, balanced1.largest_send);
  EXPECT_GT(skewed0.peak, balanced0.peak);
}

INSTANTIATE_TEST_SUITE_P(
    Schemes, DryRunMoe,
    testing::Values(MoeCase{"tsp=1", 1, kFB}, MoeCase{"tsp=1", 1, kF}, MoeCase{"tsp=1", 1, kFB, 1.5},
                    MoeCase{"tsp=2:moe=a2a", 2, kFB}, MoeCase{"tsp=2:moe=gather", 2, kFB},
                    MoeCase{"tsp=2:moe=ring", 2, kFB}, MoeCase{"tsp=2:moe=a2a", 2, kF},
                    MoeCase{"tsp=2:moe=gather", 2, kF}, MoeCase{"tsp=2:moe=ring", 2, kF},
                    MoeCase{"tsp=2:moe=a2a", 2, kFB, 1.5}, MoeCase{"tsp=2:moe=gather", 2, kFB, 1.5},
                    MoeCase{"tsp=2:moe=ring", 2, kFB, 1.5},
                    MoeCase{"tsp=4:moe=a2a", 4, kFB}, MoeCase{"tsp=4:moe=gather", 4, kFB},
                    MoeCase{"tsp=4:moe=ring", 4, kFB}, MoeCase{"tsp=4:moe=a2a", 4, kFB, 1.5},
                    // dp: the routing statistics' all-reduce over the replicas, on the dp axis.
                    MoeCase{"dp=2,tsp=1", 2, kFB}, MoeCase{"dp=2,tsp=1", 2, kF},
                    MoeCase{"dp=2,tsp=2:moe=a2a", 4, kFB}, MoeCase{"dp=2,tsp=2:moe=ring", 4, kFB},
                    MoeCase{"dp=2,tsp=2:moe=gather", 4, kF},
                    // bf16 storage: rows, weights and experts travel in 2 bytes, the decorator's copies counted.
                    MoeCase{"tsp=1:bf16", 1, kFB}, MoeCase{"tsp=2:bf16:moe=a2a", 2, kFB},
                    MoeCase{"tsp=2:bf16:moe=gather", 2, kFB}, MoeCase{"tsp=2:bf16:moe=ring", 2, kFB},
                    MoeCase{"tsp=4:bf16:moe=a2a", 4, kF}, MoeCase{"dp=2,tsp=2:bf16:moe=ring", 4, kFB},
                    // D > E: each expert's f_e split over D/E ranks (one expert at 2 ranks, two at 4).
                    MoeCase{"tsp=2:moe=a2a", 2, kFB, 1.0, 1}, MoeCase{"tsp=2:moe=gather", 2, kFB, 1.0, 1},
                    MoeCase{"tsp=2:moe=ring", 2, kFB, 1.0, 1}, MoeCase{"tsp=4:moe=a2a", 4, kFB, 1.0, 2},
                    MoeCase{"tsp=4:moe=gather", 4, kF, 1.0, 2},
                    MoeCase{"tsp=4:moe=ring", 4, kFB, 1.0, 2},
                    // The Megatron baselines' expert parallelism (parallel/megatron/tp_moe.cc),
                    // on layouts whose expert axis is a mesh axis itself (tp or sp).
                    MoeCase{"tp=2", 2, kFB}, MoeCase{"tp=2:seqpar", 2, kFB}, MoeCase{"sp=2", 2, kFB},
                    MoeCase{"tp=2", 2, kFB, 1.5}, MoeCase{"sp=2:bf16", 2, kFB}, MoeCase{"tp=4", 4, kFB},
                    MoeCase{"dp=2,sp=2", 4, kFB}, MoeCase{"tp=4", 4, kFB, 1.0, 2},
                    // Beside the mesh: the tp x sp expert axis, and experts over dp replicas
                    // (ep=4: the dispatch over "ep", the statistics over "ep" and "edp").
                    MoeCase{"tp=2,sp=2", 4, kFB}, MoeCase{"dp=2,tp=2,ep=4", 4, kFB},
                    MoeCase{"dp=2,sp=2,ep=4", 4, kFB, 1.5}, MoeCase{"dp=2,tsp=2,ep=4", 4, kFB},
                    MoeCase{"dp=2,tsp=2,ep=4:moe=gather", 4, kFB},
                    MoeCase{"dp=4,tsp=1,ep=4", 4, kFB, 1.0, 4, 0, 4}, MoeCase{"dp=2,tsp=1,ep=2", 2, kF},
                    // The expert-weight ring over the expert group: its send_recv hops on "ep".
                    MoeCase{"dp=2,tsp=2,ep=4:moe=ring", 4, kFB}, MoeCase{"dp=2,tsp=2,ep=4:moe=ring", 4, kFB, 1.5},
                    MoeCase{"dp=2,tsp=1,ep=2:moe=ring", 2, kFB}, MoeCase{"dp=2,tsp=1,ep=2:moe=ring", 2, kF},
                    MoeCase{"dp=4,tsp=1,ep=4:moe=ring", 4, kFB, 1.0, 4, 0, 4},
                    MoeCase{"dp=4,tsp=1,ep=2:moe=ring", 4, kFB, 1.0, 4, 0, 4},
                    // pp on TSP stages: the routing statistics forward and the aux gradient back
                    // beside each boundary message, the last stage's sums over tsp and dp.
                    MoeCase{"pp=2,tsp=1", 2, kFB, 1.0, 4, 1}, MoeCase{"pp=2,tsp=1", 2, kF},
                    MoeCase{"pp=2,tsp=1:interleaved=2", 2, kFB, 1.0, 4, 1, 2, 4},
                    MoeCase{"pp=2,tsp=1:bf16", 2, kFB, 1.5, 4, 1},
                    MoeCase{"pp=2,tsp=2:moe=a2a", 4, kFB, 1.0, 4, 1}, MoeCase{"pp=2,tsp=2:moe=ring", 4, kFB, 1.5, 4, 1},
                    MoeCase{"pp=2,tsp=2:moe=gather", 4, kF}, MoeCase{"pp=2,tsp=2:moe=gather", 4, kFB, 1.0, 2, 1},
                    MoeCase{"pp=2,dp=2,tsp=1", 4, kFB, 1.0, 4, 1, 4},
                    // Experts over dp replicas under pp: each stage's expert group (two dp
                    // replicas of its own), the dispatch over it, the statistics over "ep" and "edp".
                    MoeCase{"pp=2,dp=2,tsp=1,ep=2", 4, kFB, 1.0, 4, 1, 4},
                    // ... and the expert-weight ring over that group: its hops on "ep".
                    MoeCase{"pp=2,dp=2,tsp=1,ep=2:moe=ring", 4, kFB, 1.0, 4, 1, 4},
                    MoeCase{"pp=2,dp=2,tsp=1,ep=2:moe=ring", 4, kFB, 1.5, 4, 1, 4},
                    // pp on Megatron stages: the same side messages, the last stage's sums over
                    // the expert axis (tp x sp) and dp.
                    MoeCase{"pp=2,tp=1", 2, kFB, 1.0, 4, 1}, MoeCase{"pp=2,tp=1", 2, kF},
                    MoeCase{"pp=2,tp=1:interleaved=2", 2, kFB, 1.0, 4, 1, 2, 4},
                    MoeCase{"pp=2,tp=2", 4, kFB, 1.0, 4, 1}, MoeCase{"pp=2,tp=2", 4, kF},
                    MoeCase{"pp=2,tp=2:seqpar", 4, kFB, 1.5, 4, 1}, MoeCase{"pp=2,sp=2", 4, kFB, 1.0, 4, 1},
                    MoeCase{"pp=2,sp=2:bf16", 4, kFB, 1.0, 4, 1},
                    MoeCase{"pp=2,tp=2:seqpar:interleaved=2", 4, kFB, 1.0, 4, 1, 2, 4},
                    MoeCase{"pp=2,dp=2,tp=1", 4, kFB, 1.0, 4, 1, 4},
                    MoeCase{"pp=2,dp=2,tp=1,ep=2", 4, kFB, 1.5, 4, 1, 4}),
    [](const testing::TestParamInfo<MoeCase>& i) {
      std::string n = std::string(i.param.layout) + (i.param.mode == kF ? "_fwd" : "_train") +
                      (i.param.imbalance > 1 ? "_imbalanced" : "") +
                      (i.param.experts != 4 ? "_E" + std::to_string(i.param.experts) : "") +
                      (i.param.micro > 0 ? "_micro" + std::to_string(i.param.micro) : "");
      for (char& ch : n)
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

// bf16 storage under Megatron moves 2-byte elements where the tensors are bf16 (the rows of
// the tp mappings, K/V and dK/dV over sp, the ring's blocks and its dK/dV accumulator) and 4
// or 8 where they are f32 by design (the loss's statistics, the gradients summed over sp,
// the loss sums): the dry run's counters of one step (equal to the real step's, above)
// kind by kind, f32 against bf16.
TEST(DryRunBf16, MegatronMovesBf16WhereItsTensorsAreBf16) {
  auto bytes = [](const char* layout) {
    DryRunOptions o;
    o.config = validation_config();
    o.layout = parse_layout(layout).value();
    o.rank = 0;
    o.batch = 2;
    o.seq = 256;
    o.mode = DryRunMode::kForwardBackward;
    Result<DryRunResult> dry = dry_run(o);
    FP_CHECK_OK(dry.status());
    std::map<std::string, CommStats> by_axis(dry->comm.begin(), dry->comm.end());
    return by_axis;
  };
  auto sent = [](const CommStats& s, CommOpKind k) { return s.op(k).bytes_sent; };
  {  // plain tp: every all_reduce but the loss's [3n] f32 statistics carries bf16 rows
    auto f32 = bytes("tp=2"), b16 = bytes("tp=2:bf16");
    const uint64_t f = sent(f32["tp"], CommOpKind::kAllReduce), b = sent(b16["tp"], CommOpKind::kAllReduce);
    EXPECT_GT(f, 0u);
    EXPECT_LT(b, f * 52 / 100) << "tp=2: all_reduce " << b << " B in bf16 vs " << f << " B in f32";
    EXPECT_GT(b, f / 2) << "the loss's statistics stay f32";
  }
  {  // sp, all-gather exchange: K/V and dK/dV halve exactly; the gradients' sum stays f32
    auto f32 = bytes("sp=2"), b16 = bytes("sp=2:bf16");
    for (CommOpKind k : {CommOpKind::kAllGather, CommOpKind::kReduceScatter}) {
      EXPECT_GT(sent(f32["sp"], k), 0u) << comm_op_name(k);
      EXPECT_EQ(2 * sent(b16["sp"], k), sent(f32["sp"], k)) << comm_op_name(k);
    }
    EXPECT_EQ(sent(b16["sp"], CommOpKind::kAllReduce), sent(f32["sp"], CommOpKind::kAllReduce));
  }
  {  // sp, ring: the blocks and the dK/dV accumulator halve exactly
    auto f32 = bytes("sp=2:ring"), b16 = bytes("sp=2:ring:bf16");
    EXPECT_GT(sent(f32["sp"], CommOpKind::kSendRecv), 0u);
    EXPECT_EQ(2 * sent(b16["sp"], CommOpKind::kSendRecv), sent(f32["sp"], CommOpKind::kSendRecv));
  }
}

// Generation: a real prefill of B prompts of S tokens (and, for decode, one decode step
// after it), measured as the dry run measures it: peaks per category from after the
// decoder exists (prefill) or after the prefill (decode), and each axis's counters over
// the measured call. The prompts' contents do not change what is allocated or sent, except a
// MoE model's routing: its cases run on ForcedRouting (the plan's assumed routing, as
// DryRunMoe does), so each decode step's expert rows per rank are the dry run's.
struct GenCase {
  const char* layout;
  int ranks;
  DryRunMode mode;
  int64_t batch;
  bool moe = false;  // moe_validation_config() instead of validation_config()
};

Measured measure_generation(const Layout& lo, const GenCase& c, int64_t S, int64_t new_tokens) {
  Communicator& world = test::mpi().world();
  Result<Mesh> mesh = Mesh::create(world, lo.mesh());
  FP_CHECK_OK(mesh.status());
  const LlamaConfig config = c.moe ? moe_validation_config() : validation_config();
  const Batch rows = synthetic_batch(config, c.batch, S, 5);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int32_t* row = rows.input_ids.data<int32_t>() + b * S;
    prompts.emplace_back(row, row + S);
  }
  MemoryTracker& mt = MemoryTracker::process();
  mt.release_cache();
  Measured out;
  const MemoryStats before = mt.stats();  // the dry run's tracker holds only the decoder
  out.base = before.current;
  out.base_total = before.current_total;
  Result<std::unique_ptr<ShardedDecoder>> dec = make_sharded_decoder(config, *mesh, lo);
  FP_CHECK_OK(dec.status());
  (*dec)->init_weights(InitOptions{.seed = 1});
  auto cpu = make_cpu_backend();
  ForcedRouting forced(*cpu, 1.0);
  Backend* be = c.moe ? static_cast<Backend*>(&forced) : cpu.get();
  if (c.mode == DryRunMode::kDecode) FP_CHECK_OK((*dec)->prefill(*be, prompts, new_tokens).status());
  out.before_call = mt.stats().current;
  mt.reset_peaks();
  ScopedCommCounter counter(mesh->communicators());
  if (c.mode == DryRunMode::kPrefill) {
    FP_CHECK_OK((*dec)->prefill(*be, prompts, new_tokens).status());
  } else {
    std::vector<int32_t> tokens(static_cast<size_t>(c.batch));
    for (int64_t b = 0; b < c.batch; ++b) tokens[static_cast<size_t>(b)] = static_cast<int32_t>(17 + b);
    FP_CHECK_OK((*dec)->decode(*be, tokens).status());
  }
  out.step = mt.stats();
  for (const Communicator* comm : mesh->communicators()) out.axes.emplace_back(comm->name(), counter.delta(*comm));
  return out;
}

class DryRunGeneration : public testing::TestWithParam<GenCase> {};

TEST_P(DryRunGeneration, PeakAndTrafficEqualTheRealCall) {
  const GenCase c = GetParam();
  Communicator& world = test::mpi().world();
  if (world.size() != c.ranks) GTEST_SKIP() << c.layout << " runs at " << c.ranks << " ranks";
  const Layout lo = parse_layout(c.layout).value();
  const int64_t S = 200, new_tokens = 24;  // S not a multiple of D: uneven cache slots
  const Measured real = measure_generation(lo, c, S, new_tokens);
  DryRunOptions o;
  o.config = c.moe ? moe_validation_config() : validation_config();
  o.layout = lo;
  o.rank = world.rank();
  o.batch = c.batch;
  o.seq = S;
  o.mode = c.mode;
  o.max_new_tokens = new_tokens;
  Result<DryRunResult> dry = dry_run(o);
  ASSERT_TRUE(dry.ok()) << dry.status().to_string();
  const std::string what = fmt::format("{} {} B={} rank {}", c.layout,
                                       c.mode == DryRunMode::kPrefill ? "prefill" : "decode", c.batch, world.rank());
  EXPECT_EQ(dry->step.peak_total, real.step.peak_total - real.base_total) << what;
  for (int k = 0; k < kNumMemCategories; ++k) {
    EXPECT_EQ(dry->step.peak[k], real.step.peak[k] - real.base[k])
        << what << ": " << mem_category_name(static_cast<MemCategory>(k));
    // What stays after the call (the KV cache above all) is the same too.
    EXPECT_EQ(dry->step.current[k] - dry->after_build.current[k], real.step.current[k] - real.before_call[k])
        << what << ": " << mem_category_name(static_cast<MemCategory>(k)) << " after the call";
  }
  expect_same_traffic(*dry, real, what);
}

constexpr DryRunMode kPre = DryRunMode::kPrefill, kDec = DryRunMode::kDecode;
INSTANTIATE_TEST_SUITE_P(
    Layouts, DryRunGeneration,
    testing::Values(GenCase{"tsp=2", 2, kPre, 1}, GenCase{"tsp=2", 2, kPre, 3}, GenCase{"tsp=2", 2, kDec, 1},
                    GenCase{"tsp=2", 2, kDec, 3}, GenCase{"tp=2", 2, kPre, 2}, GenCase{"tp=2", 2, kDec, 2},
                    GenCase{"tsp=4", 4, kPre, 2}, GenCase{"tsp=4", 4, kDec, 2}, GenCase{"tp=4", 4, kPre, 1},
                    GenCase{"tp=4", 4, kDec, 3},
                    // MoE: the prefill is TSP's forward; each decode step routes every new token.
                    GenCase{"tsp=2", 2, kDec, 3, true}, GenCase{"tsp=2:moe=ring", 2, kPre, 2, true},
                    GenCase{"tsp=4:moe=gather", 4, kPre, 2, true}, GenCase{"tsp=4", 4, kDec, 2, true}),
    [](const testing::TestParamInfo<GenCase>& i) {
      std::string n = std::string(i.param.layout) + (i.param.mode == kPre ? "_prefill" : "_decode") + "_B" +
                      std::to_string(i.param.batch) + (i.param.moe ? "_moe" : "");
      for (char& ch : n)
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

}  // namespace
}  // namespace foldpar
