// TP x SP (the 2-D mesh tp=T,sp=S_, parallel/tpsp/) against the single-rank model, its
// reference: every rank builds the global weights and batch from one seed, computes the
// single-rank loss, logits and gradients, runs the layout through the factory (as verify
// does) on its tp slices and its tokens, and compares the loss, its own logits rows, the
// assembled logits, every assembled gradient and every ParamRef's gradient slices. Both K/V
// exchanges, zigzag and contiguous, GQA and MHA, tied and untied, overlap on and off,
// recompute, Megatron sequence parallelism; gradient accumulation and loss normalizers;
// sizes that do not divide. Layouts by world size: np 1 tp=1,sp=1; np 2 tp=2,sp=1 and
// tp=1,sp=2; np 4 tp=2,sp=2.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

#include "app/synthetic.h"
#include "comm/mesh.h"
#include "core/tolerance.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

using Exchange = LayoutOptions::KvExchange;

// n_h 8, n_kv 2 (g = 4: one KV head per rank at T = 2, so a wrong K/V head mapping shows) or
// 8; f and V divide by 2; S = 48 splits in zigzag for S_ <= 4 and S/S_ divides by T.
LlamaConfig test_config(bool tied, bool gqa, int layers) {
  LlamaConfig c;
  c.hidden_size = 64;  // d = 8
  c.num_attention_heads = 8;
  c.num_key_value_heads = gqa ? 2 : 8;
  c.intermediate_size = 112;
  c.vocab_size = 96;
  c.num_hidden_layers = layers;
  c.max_position_embeddings = 1024;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

std::vector<std::string> layouts() {
  switch (test::mpi().world().size()) {
    case 1: return {"tp=1,sp=1"};
    case 2: return {"tp=2,sp=1", "tp=1,sp=2"};
    case 4: return {"tp=2,sp=2"};
    default: return {};
  }
}

struct Case {
  Exchange exchange = Exchange::kAllGather;
  SeqSplit split = SeqSplit::kZigzag;
  bool overlap = true;
  Recompute recompute = Recompute::kNone;
  bool sequence_parallel = false;
  bool tied = false;
  bool gqa = true;
  int64_t batch = 2;
  int64_t seq = 48;
  int layers = 2;
  bool ignore_sp0 = false;  // every target of sp rank 0's tokens is ignored
};

std::string name_of(const Case& k) {
  return std::string(k.exchange == Exchange::kRing ? "ring" : "allgather") +
         (k.split == SeqSplit::kContiguous ? " contiguous" : " zigzag") + (k.overlap ? "" : " no-overlap") +
         (k.recompute == Recompute::kBlock ? " recompute" : "") + (k.sequence_parallel ? " seqpar" : "") +
         (k.tied ? " tied" : "") + (k.gqa ? " gqa" : " mha") + " B" + std::to_string(k.batch) + " S" +
         std::to_string(k.seq) + " L" + std::to_string(k.layers) + (k.ignore_sp0 ? " sp0-ignored" : "");
}

// Weights with std 0.1 so that attention is far from uniform and every path matters.
const InitOptions kInit{.seed = 7, .std = 0.1, .norm_jitter = 0.2};

struct Reference {
  LlamaConfig config;
  LlamaWeights weights;
  Batch global;
  StepResult result;
  LlamaWeights grads;
};

Reference reference(const Case& k, int sp_degree) {
  Reference ref;
  ref.config = test_config(k.tied, k.gqa, k.layers);
  const LlamaConfig& c = ref.config;
  ref.weights = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, ref.weights);
  ref.global = synthetic_batch(c, k.batch, k.seq, 11, 0.1);
  if (k.ignore_sp0) {
    for (int32_t pos : shard_positions(k.seq, sp_degree, 0, k.split))
      for (int64_t b = 0; b < k.batch; ++b) ref.global.target_ids.data<int32_t>()[b * k.seq + pos] = kIgnoreIndex;
  }
  auto be = make_cpu_backend();
  ref.grads = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref.grads.zero();
  StepOptions so;
  so.keep_logits = true;
  Result<StepResult> r = model_forward_backward(c, *be, ref.weights, ref.global, so, ref.grads);
  FP_CHECK_OK(r.status());
  ref.result = std::move(r.value());
  return ref;
}

struct Layout {
  Mesh mesh;
  std::unique_ptr<ShardedModel> model;
};

Layout make_layout(const std::string& layout, const Case& k, const LlamaConfig& c) {
  Result<Mesh> mesh = Mesh::create(test::mpi().world(), layout);
  FP_CHECK_OK(mesh.status());
  Layout out{std::move(mesh.value()), nullptr};
  LayoutOptions o;
  o.split = k.split;
  o.kv_exchange = k.exchange;
  o.overlap = k.overlap;
  o.recompute = k.recompute;
  o.sequence_parallel = k.sequence_parallel;
  o.keep_logits = true;
  Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(c, out.mesh, k.seq, o);
  FP_CHECK_OK(m.status());
  out.model = std::move(m.value());
  out.model->init_weights(kInit);
  return out;
}

// This rank's global positions, computed here independently of the model: the sp shard's,
// or with sequence parallelism the tp rank's contiguous block of them.
std::vector<int32_t> rank_positions(const Case& k, const Mesh& mesh) {
  std::vector<int32_t> pos = shard_positions(k.seq, mesh.degree("sp"), mesh.coord("sp"), k.split);
  if (!k.sequence_parallel) return pos;
  const size_t n = pos.size() / static_cast<size_t>(mesh.degree("tp")), first = n * mesh.coord("tp");
  return {pos.begin() + first, pos.begin() + first + n};
}

// The reference's logits rows at `pos`: [B, |pos|, V].
Tensor reference_rows(const Case& k, const Reference& ref, const std::vector<int32_t>& pos) {
  const int64_t V = ref.config.vocab_size, n = static_cast<int64_t>(pos.size());
  Tensor rows = Tensor::empty({k.batch, n, V}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t b = 0; b < k.batch; ++b)
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(ref.result.logits.data<float>() + (b * k.seq + pos[i]) * V, V,
                  rows.data<float>() + (b * n + i) * V);
  return rows;
}

// Every assembled gradient of `model` against `scale` times the reference's.
void expect_grads(ShardedModel& model, const Reference& ref, double scale, const std::string& what) {
  const int rank = test::mpi().world().rank();
  LlamaWeights assembled = LlamaWeights::allocate(ref.config, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(model.assemble_grads(assembled).ok());
  std::vector<Tensor> want;
  ref.grads.for_each([&](const std::string&, const Tensor& t) {
    Tensor s = t.clone(MemCategory::kWorkspace);
    for (int64_t i = 0; i < s.numel(); ++i) s.data<float>()[i] *= static_cast<float>(scale);
    want.push_back(s);
  });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    ASSERT_LT(i, want.size());
    const Tensor& w = want[i++];
    EXPECT_LE(max_rel_error(t, w), tol::kF32Parallel)
        << what << ": " << name << " on rank " << rank << "\n" << describe_mismatches(t, w, tol::kF32Parallel);
  });
  EXPECT_EQ(i, want.size());
}

// The block of a global tensor that one GlobalSlice names, laid out as the local tensor
// holds it ([rows, cols], or [cols, rows] when transposed).
Tensor global_block(const Tensor& global, const GlobalSlice& s) {
  const int64_t C = global.dim(-1);
  Tensor out = Tensor::empty({s.rows * s.cols}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t c = 0; c < s.cols; ++c)
      out.data<float>()[s.transposed ? c * s.rows + r : r * s.cols + c] =
          global.data<float>()[(s.row0 + r) * C + s.col0 + c];
  return out;
}

// Every ParamRef: its parameter and gradient slices equal the reference's blocks (so the
// norm gains' gradients are complete on every rank, not only where assemble reads them),
// and the counted elements over the whole world add up to the model's parameter count.
void expect_parameters(ShardedModel& model, const Reference& ref) {
  std::map<std::string, Tensor> weights, grads;
  ref.weights.for_each([&](const std::string& n, const Tensor& t) { weights[n] = t; });
  ref.grads.for_each([&](const std::string& n, const Tensor& t) { grads[n] = t; });
  int64_t counted = 0;
  for (const ParamRef& p : model.parameters()) {
    if (p.counted) counted += p.param.numel();
    EXPECT_EQ(p.decay, !p.name.ends_with("norm")) << p.name;
    int64_t covered = 0;
    for (const GlobalSlice& s : p.slices) {
      ASSERT_TRUE(grads.count(s.tensor)) << s.tensor;
      const int64_t n = s.rows * s.cols;
      covered += n;
      const Tensor got_g = p.grad.reshape({p.grad.numel()}).narrow(s.offset, s.offset + n);
      const Tensor got_w = p.param.reshape({p.param.numel()}).narrow(s.offset, s.offset + n);
      const Tensor want_g = global_block(grads[s.tensor], s);
      EXPECT_LE(max_rel_error(got_g, want_g), tol::kF32Parallel)
          << p.name << " / " << s.tensor << "\n" << describe_mismatches(got_g, want_g, tol::kF32Parallel);
      EXPECT_EQ(max_rel_error(got_w, global_block(weights[s.tensor], s)), 0.0) << p.name << " / " << s.tensor;
    }
    EXPECT_EQ(covered, p.param.numel()) << p.name;
  }
  ASSERT_TRUE(test::mpi().world().all_reduce(&counted, &counted, 1, DType::kI64, ReduceOp::kSum).ok());
  EXPECT_EQ(counted, ref.config.parameter_count());
}

void check_parity(const std::string& layout, const Case& k) {
  SCOPED_TRACE(layout + " " + name_of(k));
  const int rank = test::mpi().world().rank();
  Result<MeshLayout> parsed = MeshLayout::parse(layout);
  ASSERT_TRUE(parsed.ok());
  const Reference ref = reference(k, parsed->axes[1].degree);
  Layout l = make_layout(layout, k, ref.config);
  ShardedModel& model = *l.model;
  EXPECT_EQ(model.layout(), layout);
  const Batch local = model.local_batch(ref.global);
  const std::vector<int32_t> pos = rank_positions(k, l.mesh);
  ASSERT_EQ(local.seq(), static_cast<int64_t>(pos.size()));
  auto be = make_cpu_backend();
  Result<StepResult> got = model.forward_backward(*be, local, 0);
  ASSERT_TRUE(got.ok()) << got.status().to_string();

  // f32; only the order of summation differs (partial outputs summed over tp, the
  // log-sum-exp over vocabulary shards, gradients over sp): kF32Parallel.
  EXPECT_EQ(got->valid_tokens, ref.result.valid_tokens);
  EXPECT_NEAR(got->loss, ref.result.loss, tol::kF32Parallel * ref.result.loss);
  EXPECT_NEAR(got->loss_sum, ref.result.loss_sum, tol::kF32Parallel * ref.result.loss_sum);
  EXPECT_TRUE(std::isfinite(got->exposed_comm_seconds) && got->exposed_comm_seconds >= 0);
  const Tensor rows = reference_rows(k, ref, pos);
  EXPECT_LE(max_rel_error(got->logits, rows), tol::kF32Parallel)
      << "logits of rank " << rank << "\n" << describe_mismatches(got->logits, rows, tol::kF32Parallel);
  Tensor global_logits = Tensor::empty(ref.result.logits.shape(), DType::kF32, MemCategory::kWorkspace);
  ASSERT_TRUE(model.assemble_logits(got->logits, global_logits).ok());
  EXPECT_LE(max_rel_error(global_logits, ref.result.logits), tol::kF32Parallel) << "assembled logits";
  expect_grads(model, ref, 1.0, "one step");
  expect_parameters(model, ref);

  // Forward alone: the same loss and logits.
  Result<StepResult> fwd = model.forward(*be, local);
  ASSERT_TRUE(fwd.ok()) << fwd.status().to_string();
  EXPECT_EQ(fwd->valid_tokens, ref.result.valid_tokens);
  EXPECT_NEAR(fwd->loss, ref.result.loss, tol::kF32Parallel * ref.result.loss);
  EXPECT_LE(max_rel_error(fwd->logits, rows), tol::kF32Parallel) << "forward logits of rank " << rank;

  // Weights: the single-rank model's, bit for bit.
  LlamaWeights got_w = LlamaWeights::allocate(ref.config, DType::kF32, MemCategory::kWorkspace);
  ASSERT_TRUE(model.assemble_weights(got_w).ok());
  std::vector<Tensor> want_w;
  ref.weights.for_each([&](const std::string&, const Tensor& t) { want_w.push_back(t); });
  size_t i = 0;
  got_w.for_each([&](const std::string& name, Tensor& t) { EXPECT_EQ(max_rel_error(t, want_w[i++]), 0.0) << name; });
}

class TpspParity : public ::testing::Test {
 protected:
  void SetUp() override {
    if (layouts().empty()) GTEST_SKIP() << "layouts are listed for 1, 2 and 4 ranks";
  }
  static void run(const Case& k) {
    for (const std::string& layout : layouts()) check_parity(layout, k);
  }
};

TEST_F(TpspParity, AllGatherZigzagGqa) { run(Case{}); }

TEST_F(TpspParity, RingZigzagGqa) { run(Case{.exchange = Exchange::kRing}); }

TEST_F(TpspParity, ContiguousBothExchanges) {
  run(Case{.split = SeqSplit::kContiguous});
  run(Case{.exchange = Exchange::kRing, .split = SeqSplit::kContiguous, .overlap = false});
}

TEST_F(TpspParity, TiedAndMultiHead) {
  run(Case{.tied = true, .gqa = false});
  run(Case{.exchange = Exchange::kRing, .tied = true});
  run(Case{.overlap = false, .gqa = false});
}

TEST_F(TpspParity, RecomputeBlocks) {
  run(Case{.recompute = Recompute::kBlock});
  run(Case{.exchange = Exchange::kRing,
           .split = SeqSplit::kContiguous,
           .overlap = false,
           .recompute = Recompute::kBlock,
           .tied = true,
           .gqa = false});
}

TEST_F(TpspParity, MegatronSequenceParallelInsideTheTpGroup) {
  run(Case{.sequence_parallel = true});
  run(Case{.exchange = Exchange::kRing, .recompute = Recompute::kBlock, .sequence_parallel = true});
  run(Case{.split = SeqSplit::kContiguous,
           .overlap = false,
           .recompute = Recompute::kBlock,
           .sequence_parallel = true,
           .tied = true,
           .gqa = false});
}

TEST_F(TpspParity, OneLayerOneSequence) { run(Case{.batch = 1, .seq = 24, .layers = 1}); }

TEST_F(TpspParity, RankWithOnlyIgnoredTargets) {
  // The mean runs over the valid tokens of the whole global batch, counted across sp. (At
  // S_ = 1 every target is ignored: loss 0 and zero gradients, not NaN.)
  run(Case{.ignore_sp0 = true});
  run(Case{.exchange = Exchange::kRing, .sequence_parallel = true, .ignore_sp0 = true});
}

// Two steps without zeroing: only each step's partial is summed over sp, so the gradients
// are twice one step's (summing everything again would give 1 + S_). Then a loss normalizer:
// the gradient of loss_sum / N is the reference's (of loss_sum / valid) times valid / N, and
// two micro-batches each normalized by the pair's count give the mean's gradient.
TEST_F(TpspParity, GradientsAccumulateAndHonourTheLossNormalizer) {
  for (const std::string& layout : layouts())
    for (bool seq_par : {false, true}) {
      const Case k{.exchange = seq_par ? Exchange::kRing : Exchange::kAllGather, .sequence_parallel = seq_par};
      SCOPED_TRACE(layout + " " + name_of(k));
      const Reference ref = reference(k, MeshLayout::parse(layout)->axes[1].degree);
      Layout l = make_layout(layout, k, ref.config);
      ShardedModel& m = *l.model;
      const Batch local = m.local_batch(ref.global);
      auto be = make_cpu_backend();
      ASSERT_TRUE(m.forward_backward(*be, local, 0).ok());
      ASSERT_TRUE(m.forward_backward(*be, local, 0).ok());
      expect_grads(m, ref, 2.0, "two steps");
      ASSERT_TRUE(m.forward_backward(*be, local, 0).ok());
      expect_grads(m, ref, 3.0, "three steps");

      const int64_t valid = ref.result.valid_tokens, N = 3 * valid + 5;
      m.zero_grads();
      Result<StepResult> r = m.forward_backward(*be, local, N);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_NEAR(r->loss, ref.result.loss, tol::kF32Parallel * ref.result.loss) << "the loss is not rescaled";
      EXPECT_EQ(r->valid_tokens, valid);
      expect_grads(m, ref, static_cast<double>(valid) / static_cast<double>(N), "loss_sum / N");

      m.zero_grads();
      ASSERT_TRUE(m.forward_backward(*be, local, 2 * valid).ok());
      ASSERT_TRUE(m.forward_backward(*be, local, 2 * valid).ok());
      expect_grads(m, ref, 1.0, "two micro-batches normalized by their joint count");
    }
}

// ---- sizes that do not divide ----

std::string factory_error(const std::string& layout, const LlamaConfig& c, int64_t seq, const LayoutOptions& o,
                          StatusCode* code = nullptr) {
  Result<Mesh> mesh = Mesh::create(test::mpi().world(), layout);
  FP_CHECK_OK(mesh.status());
  Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(c, *mesh, seq, o);
  if (code != nullptr) *code = m.ok() ? StatusCode::kOk : m.status().code();
  return m.ok() ? std::string("ok") : m.status().message();
}

TEST(TpspErrors, SizesThatDoNotDivideNameTheNumbers) {
  if (layouts().empty()) GTEST_SKIP() << "layouts are listed for 1, 2 and 4 ranks";
  for (const std::string& layout : layouts()) {
    SCOPED_TRACE(layout);
    const MeshLayout ml = MeshLayout::parse(layout).value();
    const int T = ml.axes[0].degree, P = ml.axes[1].degree;
    const LlamaConfig c = test_config(false, true, 1);
    const LayoutOptions plain;
    EXPECT_EQ(factory_error(layout, c, 48, plain), "ok");
    StatusCode code = StatusCode::kOk;
    if (T > 1) {
      const std::string deg = "the tp degree (" + std::to_string(T) + ")";
      LlamaConfig bad = c;
      bad.num_attention_heads = 5;
      bad.num_key_value_heads = 5;
      bad.hidden_size = 40;
      std::string msg = factory_error(layout, bad, 48, plain, &code);
      EXPECT_NE(msg.find("num_attention_heads (5) must be divisible by " + deg), std::string::npos) << msg;
      EXPECT_EQ(code, StatusCode::kInvalidArgument);
      bad = c;
      bad.num_key_value_heads = 1;
      msg = factory_error(layout, bad, 48, plain);
      EXPECT_NE(msg.find("num_key_value_heads (1) must be divisible by " + deg), std::string::npos) << msg;
      bad = c;
      bad.intermediate_size = 111;
      msg = factory_error(layout, bad, 48, plain);
      EXPECT_NE(msg.find("intermediate_size (111) must be divisible by " + deg), std::string::npos) << msg;
      bad = c;
      bad.vocab_size = 97;
      msg = factory_error(layout, bad, 48, plain);
      EXPECT_NE(msg.find("vocab_size (97) must be divisible by " + deg), std::string::npos) << msg;
    }
    // Zigzag needs S % 2 S_.
    const int64_t odd = 2 * P + 1;  // never divisible by 2 S_
    std::string msg = factory_error(layout, c, odd, plain, &code);
    EXPECT_NE(msg.find("sequence length (" + std::to_string(odd) + ") must be divisible by 2 x the sequence degree (2 x " +
                       std::to_string(P) + " = " + std::to_string(2 * P) + ")"),
              std::string::npos)
        << msg;
    EXPECT_EQ(code, StatusCode::kInvalidArgument);
    // Sequence parallelism needs S/S_ % T (contiguous: S = 3 S_ gives 3 rows per sp rank).
    LayoutOptions sp;
    sp.sequence_parallel = true;
    sp.split = SeqSplit::kContiguous;
    msg = factory_error(layout, c, 3 * P, sp, &code);
    if (T == 1) {
      EXPECT_EQ(msg, "ok");
    } else {
      EXPECT_NE(msg.find("sequence length (" + std::to_string(3 * P) + ") must be divisible by the sp degree x the tp "
                         "degree (" + std::to_string(P) + " x " + std::to_string(T) + " = " +
                         std::to_string(P * T) + ") with sequence parallelism"),
                std::string::npos)
          << msg;
      EXPECT_EQ(code, StatusCode::kInvalidArgument);
    }
  }
}

TEST(TpspErrors, LocalBatchOfTheWrongLength) {
  if (layouts().empty()) GTEST_SKIP() << "layouts are listed for 1, 2 and 4 ranks";
  for (const std::string& layout : layouts()) {
    const Case k{};
    const LlamaConfig c = test_config(false, true, 1);
    Layout l = make_layout(layout, k, c);
    const Batch global = synthetic_batch(c, 1, 2 * k.seq, 3);  // never a rank's length
    Result<StepResult> r = l.model->forward(*make_cpu_backend(), global);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("local batch has 96 tokens per sequence"), std::string::npos)
        << r.status().to_string();
  }
}

}  // namespace
}  // namespace foldpar
