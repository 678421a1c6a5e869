// Megatron tensor parallelism against the single-rank model (its reference): every rank
// builds the global weights and batch from one seed, computes the single-rank loss, logits
// and gradients, runs the tp step on its weight shards (and, with sequence parallelism, its
// sequence rows), and compares the loss, its logits rows and every gradient assembled from
// every rank's shards. Run under mpirun at 1, 2, 3 and 4 ranks (T = the world size). Also:
// the sequence mappings' adjoint identity, the ShardedModel built by the factory, and the
// errors for sizes that do not divide.
#include <gtest/gtest.h>

#include <cmath>

#include "app/synthetic.h"
#include "comm/mesh.h"
#include "core/tolerance.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"
#include "parallel/tensor_parallel.h"
#include "parallel/tp/tp_model.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

// Sizes that divide for T = 1, 2, 4 (GQA g = 2: two KV heads per rank at T = 4) and a second
// config for T = 3. S = 48 divides by every T, for sequence parallelism.
LlamaConfig test_config(int T, bool tied, bool gqa, int layers) {
  LlamaConfig c;
  if (T == 3) {
    c.hidden_size = 48;  // d = 8
    c.num_attention_heads = 6;
    c.num_key_value_heads = gqa ? 3 : 6;
    c.intermediate_size = 72;
    c.vocab_size = 99;
  } else {
    c.hidden_size = 128;  // d = 8
    c.num_attention_heads = 16;
    c.num_key_value_heads = gqa ? 8 : 16;
    c.intermediate_size = 160;
    c.vocab_size = 128;
  }
  c.num_hidden_layers = layers;
  c.max_position_embeddings = 1024;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

struct Case {
  std::string name;
  bool sequence_parallel = false;
  bool gqa = true;
  bool tied = false;
  Recompute recompute = Recompute::kNone;
  int layers = 2;
  bool overlap = true;
  bool ignore_rank0 = false;  // every target in rank 0's sequence block is ignored
};

// How GoogleTest names a case in a failure.
void PrintTo(const Case& k, std::ostream* os) { *os << k.name; }

// Weights with std 0.1 so that attention is far from uniform and every path matters.
const InitOptions kInit{.seed = 7, .std = 0.1, .norm_jitter = 0.2};
constexpr int64_t kBatch = 2, kSeq = 48;

struct Reference {
  LlamaConfig config;
  Batch batch;
  StepResult result;
  LlamaWeights grads;
};

Reference reference(const Case& k, int T) {
  Reference ref;
  ref.config = test_config(T, k.tied, k.gqa, k.layers);
  LlamaWeights w = LlamaWeights::allocate(ref.config, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  ref.batch = synthetic_batch(ref.config, kBatch, kSeq, 11, 0.1);
  if (k.ignore_rank0) {
    for (int64_t b = 0; b < kBatch; ++b)
      for (int64_t i = 0; i < kSeq / T; ++i) ref.batch.target_ids.data<int32_t>()[b * kSeq + i] = kIgnoreIndex;
  }
  auto be = make_cpu_backend();
  ref.grads = LlamaWeights::allocate(ref.config, DType::kF32, MemCategory::kGradients);
  ref.grads.zero();
  StepOptions so;
  so.keep_logits = true;
  Result<StepResult> r = model_forward_backward(ref.config, *be, w, ref.batch, so, ref.grads);
  FP_CHECK_OK(r.status());
  ref.result = std::move(r.value());
  return ref;
}

// The reference logits of this rank's rows [B, S_local, V].
Tensor reference_rows(const Reference& ref, const TpModel& m) {
  const int64_t Sl = m.local_seq(), V = ref.config.vocab_size;
  const int64_t first = m.options().sequence_parallel ? m.rank() * Sl : 0;
  Tensor rows = Tensor::empty({kBatch, Sl, V}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t b = 0; b < kBatch; ++b)
    std::copy_n(ref.result.logits.data<float>() + (b * kSeq + first) * V, Sl * V, rows.data<float>() + b * Sl * V);
  return rows;
}

void expect_grads(const LlamaWeights& got, const Reference& ref, int rank) {
  std::vector<std::pair<std::string, Tensor>> want;
  const_cast<LlamaWeights&>(ref.grads).for_each([&](const std::string& n, Tensor& t) { want.emplace_back(n, t); });
  size_t i = 0;
  const_cast<LlamaWeights&>(got).for_each([&](const std::string& name, Tensor& t) {
    ASSERT_LT(i, want.size());
    const Tensor& w = want[i++].second;
    EXPECT_LE(max_rel_error(t, w), tol::kF32Parallel)
        << name << " on rank " << rank << "\n" << describe_mismatches(t, w, tol::kF32Parallel);
  });
  EXPECT_EQ(i, want.size());
}

class TpParity : public ::testing::TestWithParam<Case> {};

TEST_P(TpParity, LossLogitsAndEveryGradientMatchTheSingleRankModel) {
  const Case k = GetParam();
  Communicator& world = test::mpi().world();
  const int T = world.size(), t = world.rank();
  const Reference ref = reference(k, T);

  TpOptions opt;
  opt.sequence_parallel = k.sequence_parallel;
  opt.recompute = k.recompute;
  opt.overlap = k.overlap;
  opt.keep_logits = true;
  Result<TpModel> model = TpModel::create(ref.config, T, t, kSeq, opt);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ShardedWeights w = ShardedWeights::allocate(ref.config, model->dims(), t, DType::kF32, MemCategory::kParameters);
  init_sharded_weights(kInit, w);
  ShardedWeights g = ShardedWeights::allocate(ref.config, model->dims(), t, DType::kF32, MemCategory::kGradients);
  g.zero();
  const Batch local = model->local_batch(ref.batch);
  ASSERT_EQ(local.seq(), k.sequence_parallel ? kSeq / T : kSeq);
  auto be = make_cpu_backend();

  // f32 in another summation order (partial outputs summed over ranks, the log-sum-exp
  // over vocabulary shards): observed errors near 1e-6, kF32Parallel leaves a margin of 10.
  Result<StepResult> fwd = model->forward(*be, world, w, local);
  ASSERT_TRUE(fwd.ok()) << fwd.status().to_string();
  Result<StepResult> got = model->forward_backward(*be, world, w, local, g);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  const Tensor want_rows = reference_rows(ref, *model);
  for (const StepResult* r : {&fwd.value(), &got.value()}) {
    EXPECT_EQ(r->valid_tokens, ref.result.valid_tokens);
    EXPECT_NEAR(r->loss, ref.result.loss, tol::kF32Parallel * ref.result.loss);
    EXPECT_NEAR(r->loss_sum, ref.result.loss_sum, tol::kF32Parallel * ref.result.loss_sum);
    EXPECT_LE(max_rel_error(r->logits, want_rows), tol::kF32Parallel)
        << "logits of rank " << t << "\n" << describe_mismatches(r->logits, want_rows, tol::kF32Parallel);
    EXPECT_TRUE(std::isfinite(r->exposed_comm_seconds) && r->exposed_comm_seconds >= 0);
  }
  LlamaWeights assembled = LlamaWeights::allocate(ref.config, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(assemble_global(g, world, assembled).ok());
  expect_grads(assembled, ref, t);
  // The replicated norm gains' gradients are complete on every rank, not only on rank 0
  // (assemble_global takes them from rank 0).
  LlamaWeights own = LlamaWeights::allocate(ref.config, DType::kF32, MemCategory::kGradients);
  own.zero();
  unshard_into_global(g, /*replicated=*/true, own);
  for (size_t l = 0; l < own.layers.size(); ++l) {
    EXPECT_LE(max_rel_error(own.layers[l].attn_norm, ref.grads.layers[l].attn_norm), tol::kF32Parallel) << l;
    EXPECT_LE(max_rel_error(own.layers[l].mlp_norm, ref.grads.layers[l].mlp_norm), tol::kF32Parallel) << l;
  }
  EXPECT_LE(max_rel_error(own.final_norm, ref.grads.final_norm), tol::kF32Parallel);

  // Gradients accumulate: a second step doubles them.
  ASSERT_TRUE(model->forward_backward(*be, world, w, local, g).ok());
  ASSERT_TRUE(assemble_global(g, world, assembled).ok());
  Tensor twice = ref.grads.layers[0].wq.clone(MemCategory::kWorkspace);
  be->scale_inplace(2.0, twice);
  EXPECT_LE(max_rel_error(assembled.layers[0].wq, twice), tol::kF32Parallel);
}

Case with(Case k, const char* name) {
  k.name = name;
  return k;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  // GQA and MHA, tied and untied, with and without sequence parallelism.
  for (bool sp : {false, true})
    for (bool gqa : {true, false})
      for (bool tied : {false, true}) {
        Case k{};
        k.name = std::string(sp ? "sp" : "plain") + (gqa ? "_gqa" : "_mha") + (tied ? "_tied" : "_untied");
        k.sequence_parallel = sp;
        k.gqa = gqa;
        k.tied = tied;
        out.push_back(k);
      }
  Case plain{}, sp{};
  sp.sequence_parallel = true;
  for (const Case& base : {plain, sp}) {
    const bool s = base.sequence_parallel;
    Case k = base;
    k.recompute = Recompute::kBlock;
    out.push_back(with(k, s ? "sp_recompute" : "plain_recompute"));
    k.tied = true;
    k.gqa = false;
    out.push_back(with(k, s ? "sp_recompute_tied_mha" : "plain_recompute_tied_mha"));
    k = base;
    k.layers = 1;
    out.push_back(with(k, s ? "sp_one_layer" : "plain_one_layer"));
    k = base;
    k.overlap = false;
    out.push_back(with(k, s ? "sp_no_overlap" : "plain_no_overlap"));
    k.recompute = Recompute::kBlock;
    out.push_back(with(k, s ? "sp_no_overlap_recompute" : "plain_no_overlap_recompute"));
    k = base;
    k.ignore_rank0 = true;
    out.push_back(with(k, s ? "sp_rank0_rows_ignored" : "plain_rank0_rows_ignored"));
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Layouts, TpParity, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(TpShardedModel, FactoryAssemblesWeightsGradientsAndLogits) {
  Communicator& world = test::mpi().world();
  const int T = world.size();
  for (bool sp : {false, true}) {
    Case k{};
    k.sequence_parallel = sp;
    k.recompute = Recompute::kBlock;
    const Reference ref = reference(k, T);
    Result<Mesh> mesh = Mesh::create(world, "tp=" + std::to_string(T));
    ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
    LayoutOptions lo;
    lo.sequence_parallel = sp;
    lo.recompute = k.recompute;
    lo.keep_logits = true;
    Result<std::unique_ptr<ShardedModel>> model = make_sharded_model(ref.config, *mesh, kSeq, lo);
    ASSERT_TRUE(model.ok()) << model.status().to_string();
    ShardedModel& m = **model;
    EXPECT_EQ(m.layout(), "tp=" + std::to_string(T));
    m.init_weights(kInit);
    Result<StepResult> got = m.forward_backward(*make_cpu_backend(), m.local_batch(ref.batch), 0);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_NEAR(got->loss, ref.result.loss, tol::kF32Parallel * ref.result.loss);
    Tensor logits = Tensor::empty(ref.result.logits.shape(), DType::kF32, MemCategory::kWorkspace);
    ASSERT_TRUE(m.assemble_logits(got->logits, logits).ok());
    EXPECT_LE(max_rel_error(logits, ref.result.logits), tol::kF32Parallel) << (sp ? "sp" : "plain");
    LlamaWeights grads = LlamaWeights::allocate(ref.config, DType::kF32, MemCategory::kGradients);
    ASSERT_TRUE(m.assemble_grads(grads).ok());
    expect_grads(grads, ref, world.rank());
    LlamaWeights weights = LlamaWeights::allocate(ref.config, DType::kF32, MemCategory::kParameters);
    ASSERT_TRUE(m.assemble_weights(weights).ok());
    LlamaWeights want = LlamaWeights::allocate(ref.config, DType::kF32, MemCategory::kParameters);
    init_weights(kInit, want);
    std::vector<Tensor> want_list;
    want.for_each([&](const std::string&, Tensor& t) { want_list.push_back(t); });
    size_t i = 0;
    weights.for_each([&](const std::string& name, Tensor& t) { EXPECT_EQ(max_rel_error(t, want_list[i++]), 0.0) << name; });
  }
}

// sum over ranks <all_gather_seq(x), y> == sum over ranks <x, reduce_scatter_seq(y)>, exact
// on integer values; and the gathered rows land in their places (rank r's block of every
// batch entry at [r*n, (r+1)*n)). B = 3 exercises the rank-major staging.
TEST(TpMappings, SequenceGatherAndReduceScatterAreAdjoint) {
  Communicator& world = test::mpi().world();
  const int T = world.size(), t = world.rank();
  const int64_t B = 3, n = 2, c = 5;
  auto be = make_cpu_backend();
  for (bool overlap : {true, false}) {
    TpComm tp(world, *be, overlap);
    Tensor x = Tensor::empty({B, n, c}, DType::kF32, MemCategory::kWorkspace);
    Tensor y = Tensor::empty({B, T * n, c}, DType::kF32, MemCategory::kWorkspace);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = static_cast<float>((t * 7 + i * 3) % 11) - 5;
    for (int64_t i = 0; i < y.numel(); ++i) y.data<float>()[i] = static_cast<float>((t * 5 + i * 2) % 9) - 4;
    Tensor gx = Tensor::empty({B, T * n, c}, DType::kF32, MemCategory::kWorkspace);
    Tensor ry = Tensor::empty({B, n, c}, DType::kF32, MemCategory::kWorkspace);
    tp.all_gather_seq(x, gx);
    TpComm::Pending p = tp.start_reduce_scatter_seq(y, ry);
    tp.wait(p);
    // Placement: element (b, r*n + i, j) of gx is rank r's x(b, i, j).
    for (int64_t b = 0; b < B; ++b)
      for (int r = 0; r < T; ++r)
        for (int64_t i = 0; i < n * c; ++i) {
          const float want = static_cast<float>((r * 7 + (b * n * c + i) * 3) % 11) - 5;
          ASSERT_EQ(gx.data<float>()[(b * T + r) * n * c + i], want) << "b " << b << " rank " << r << " i " << i;
        }
    double sums[2] = {0, 0};
    for (int64_t i = 0; i < gx.numel(); ++i) sums[0] += gx.data<float>()[i] * y.data<float>()[i];
    for (int64_t i = 0; i < x.numel(); ++i) sums[1] += x.data<float>()[i] * ry.data<float>()[i];
    ASSERT_TRUE(world.all_reduce(sums, sums, 2, DType::kF64, ReduceOp::kSum).ok());
    EXPECT_EQ(sums[0], sums[1]) << (overlap ? "overlap" : "no overlap");
    // all_reduce is self-adjoint; its result is the sum on every rank.
    Tensor z = x.clone(MemCategory::kWorkspace);
    tp.all_reduce(z);
    for (int64_t i = 0; i < z.numel(); ++i) {
      double want = 0;
      for (int r = 0; r < T; ++r) want += static_cast<float>((r * 7 + i * 3) % 11) - 5;
      ASSERT_EQ(z.data<float>()[i], want) << i;
    }
  }
}

TEST(TpErrors, SizesThatDoNotDivide) {
  const int T = test::mpi().world().size();
  if (T == 1) GTEST_SKIP() << "everything divides by 1";
  const LlamaConfig c = test_config(T, false, true, 2);
  auto message = [&](const LlamaConfig& cfg, int64_t seq, bool sp) {
    TpOptions o;
    o.sequence_parallel = sp;
    Result<TpModel> m = TpModel::create(cfg, T, 0, seq, o);
    return m.ok() ? std::string("ok") : m.status().to_string();
  };
  const std::string deg = "the tp degree (" + std::to_string(T) + ")";
  LlamaConfig bad = c;
  bad.num_attention_heads = T * 4 + 1;
  bad.num_key_value_heads = 1;
  bad.hidden_size = bad.num_attention_heads * 2;
  EXPECT_NE(message(bad, 48, false).find("num_attention_heads (" + std::to_string(T * 4 + 1) + ") must be divisible by " +
                                         deg),
            std::string::npos)
      << message(bad, 48, false);
  bad = c;
  bad.num_key_value_heads = 1;  // divides n_h, not T
  EXPECT_NE(message(bad, 48, false).find("num_key_value_heads (1) must be divisible by " + deg), std::string::npos)
      << message(bad, 48, false);
  bad = c;
  bad.intermediate_size = T * 10 + 1;
  EXPECT_NE(message(bad, 48, false).find("intermediate_size (" + std::to_string(T * 10 + 1) + ") must be divisible by " +
                                         deg),
            std::string::npos);
  bad = c;
  bad.vocab_size = T * 10 + 1;
  EXPECT_NE(message(bad, 48, false).find("vocab_size (" + std::to_string(T * 10 + 1) + ") must be divisible by " + deg),
            std::string::npos);
  const int64_t odd = 4 * T + 1;
  EXPECT_EQ(message(c, odd, false), "ok") << "plain TP does not shard the sequence";
  EXPECT_NE(message(c, odd, true).find("sequence length (" + std::to_string(odd) + ") must be divisible by " + deg +
                                       " with sequence parallelism"),
            std::string::npos)
      << message(c, odd, true);
  // Every error is invalid_argument, also through the factory.
  Result<Mesh> mesh = Mesh::create(test::mpi().world(), "tp=" + std::to_string(T));
  ASSERT_TRUE(mesh.ok());
  LayoutOptions lo;
  lo.sequence_parallel = true;
  Result<std::unique_ptr<ShardedModel>> m = make_sharded_model(c, *mesh, odd, lo);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status().to_string();
}

TEST(TpErrors, LocalBatchOfTheWrongLength) {
  const int T = test::mpi().world().size();
  const LlamaConfig c = test_config(T, false, true, 1);
  TpOptions o;
  o.sequence_parallel = true;
  Result<TpModel> m = TpModel::create(c, T, test::mpi().world().rank(), kSeq, o);
  ASSERT_TRUE(m.ok());
  ShardedWeights w = ShardedWeights::allocate(c, m->dims(), m->rank(), DType::kF32, MemCategory::kParameters);
  init_sharded_weights(kInit, w);
  // The global batch instead of the rank's rows: refused before any communication.
  const Batch global = synthetic_batch(c, 1, kSeq, 3);
  if (T > 1) {
    Result<StepResult> r = m->forward(*make_cpu_backend(), test::mpi().world(), w, global);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("local batch has 48 tokens per sequence"), std::string::npos)
        << r.status().to_string();
  }
}

}  // namespace
}  // namespace foldpar
