// SP (sequence parallelism, replicated weights) against the single-rank model, its
// reference: every rank builds the global weights and batch from one seed, computes the
// single-rank loss, logits and gradients, runs the SP step (through the ShardedModel
// interface, as verify does) on its tokens, and compares the loss, its own logits rows, the
// assembled logits and every gradient. Both K/V exchanges, zigzag and contiguous, GQA and
// MHA, tied and untied, overlap on and off, recompute; gradient accumulation; the ring
// attention pieces on their own; and sizes that do not divide. Run under mpirun at 1, 2, 3
// and 4 ranks (S_ = the world size).
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "app/synthetic.h"
#include "comm/mesh.h"
#include "core/rng.h"
#include "core/tolerance.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"
#include "parallel/ring_attention.h"
#include "parallel/strategies.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

using Exchange = LayoutOptions::KvExchange;

// SP needs no head or width divisibility; S = 48 splits in zigzag for S_ = 1..4 (2 S_ | 48).
// GQA with g = 4 so that a wrong K/V head mapping shows.
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

struct Case {
  Exchange exchange = Exchange::kAllGather;
  SeqSplit split = SeqSplit::kZigzag;
  bool overlap = true;
  Recompute recompute = Recompute::kNone;
  bool tied = false;
  bool gqa = true;
  int64_t batch = 2;
  int64_t seq = 48;
  int layers = 2;
  bool ignore_rank0 = false;  // every target of rank 0's tokens is ignored
};

// Weights with std 0.1 so that attention is far from uniform and every path matters.
const InitOptions kInit{.seed = 7, .std = 0.1, .norm_jitter = 0.2};

struct Reference {
  LlamaConfig config;
  Batch global;
  StepResult result;
  LlamaWeights grads;
};

Reference reference(const Case& k) {
  const int D = test::mpi().world().size();
  Reference ref;
  ref.config = test_config(k.tied, k.gqa, k.layers);
  const LlamaConfig& c = ref.config;
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  ref.global = synthetic_batch(c, k.batch, k.seq, 11, 0.1);
  if (k.ignore_rank0) {
    for (int32_t pos : shard_positions(k.seq, D, 0, k.split))
      for (int64_t b = 0; b < k.batch; ++b) ref.global.target_ids.data<int32_t>()[b * k.seq + pos] = kIgnoreIndex;
  }
  auto be = make_cpu_backend();
  ref.grads = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref.grads.zero();
  StepOptions so;
  so.keep_logits = true;
  Result<StepResult> r = model_forward_backward(c, *be, w, ref.global, so, ref.grads);
  FP_CHECK_OK(r.status());
  ref.result = std::move(r.value());
  return ref;
}

std::unique_ptr<ShardedModel> make_model(const Case& k, const LlamaConfig& c) {
  LayoutOptions o;
  o.split = k.split;
  o.kv_exchange = k.exchange;
  o.overlap = k.overlap;
  o.recompute = k.recompute;
  o.keep_logits = true;
  Result<std::unique_ptr<ShardedModel>> m = make_sp_sharded_model(c, test::mpi().world(), k.seq, o);
  FP_CHECK_OK(m.status());
  std::unique_ptr<ShardedModel> model = std::move(m.value());
  model->init_weights(kInit);
  return model;
}

// The reference's logits rows of this rank's tokens: [B, S/S_, V].
Tensor reference_rows(const Case& k, const Reference& ref) {
  const Communicator& world = test::mpi().world();
  const std::vector<int32_t> pos = shard_positions(k.seq, world.size(), world.rank(), k.split);
  const int64_t V = ref.config.vocab_size, Sl = static_cast<int64_t>(pos.size());
  Tensor rows = Tensor::empty({k.batch, Sl, V}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t b = 0; b < k.batch; ++b)
    for (int64_t i = 0; i < Sl; ++i)
      std::copy_n(ref.result.logits.data<float>() + (b * k.seq + pos[i]) * V, V,
                  rows.data<float>() + (b * Sl + i) * V);
  return rows;
}

// Every gradient of `model` (assembled) against `scale` times the reference's.
void expect_grads(ShardedModel& model, const Reference& ref, double scale, const std::string& what) {
  const int p = test::mpi().world().rank();
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
    const Tensor& w = want[i++];
    EXPECT_LE(max_rel_error(t, w), tol::kF32Parallel)
        << what << ": " << name << " on rank " << p << "\n" << describe_mismatches(t, w, tol::kF32Parallel);
  });
}

void check_parity(const Case& k) {
  const int p = test::mpi().world().rank();
  const Reference ref = reference(k);
  const LlamaConfig& c = ref.config;
  std::unique_ptr<ShardedModel> model = make_model(k, c);
  const Batch local = model->local_batch(ref.global);
  auto be = make_cpu_backend();
  Result<StepResult> got = model->forward_backward(*be, local, 0);
  ASSERT_TRUE(got.ok()) << got.status().to_string();

  // f32; only the order of summation differs (the online softmax over ranks, gradients
  // summed over ranks): kF32Parallel.
  EXPECT_EQ(got->valid_tokens, ref.result.valid_tokens);
  EXPECT_NEAR(got->loss, ref.result.loss, tol::kF32Parallel * ref.result.loss);
  EXPECT_NEAR(got->loss_sum, ref.result.loss_sum, tol::kF32Parallel * ref.result.loss_sum);
  EXPECT_GE(got->exposed_comm_seconds, 0.0);
  const Tensor rows = reference_rows(k, ref);
  EXPECT_LE(max_rel_error(got->logits, rows), tol::kF32Parallel)
      << "logits of rank " << p << "\n" << describe_mismatches(got->logits, rows, tol::kF32Parallel);
  Tensor global_logits = Tensor::empty(ref.result.logits.shape(), DType::kF32, MemCategory::kWorkspace);
  ASSERT_TRUE(model->assemble_logits(got->logits, global_logits).ok());
  EXPECT_LE(max_rel_error(global_logits, ref.result.logits), tol::kF32Parallel) << "assembled logits";
  expect_grads(*model, ref, 1.0, "one step");

  // Forward alone: the same loss and logits.
  Result<StepResult> fwd = model->forward(*be, local);
  ASSERT_TRUE(fwd.ok()) << fwd.status().to_string();
  EXPECT_NEAR(fwd->loss, ref.result.loss, tol::kF32Parallel * ref.result.loss);
  EXPECT_LE(max_rel_error(fwd->logits, rows), tol::kF32Parallel) << "forward logits of rank " << p;

  // Weights: replicas of the single-rank model's, bit for bit.
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  LlamaWeights got_w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kWorkspace);
  ASSERT_TRUE(model->assemble_weights(got_w).ok());
  std::vector<Tensor> want_w;
  w.for_each([&](const std::string&, Tensor& t) { want_w.push_back(t); });
  size_t i = 0;
  got_w.for_each([&](const std::string& name, Tensor& t) { EXPECT_EQ(max_rel_error(t, want_w[i++]), 0.0) << name; });
}

std::string name_of(const Case& k) {
  return std::string(k.exchange == Exchange::kRing ? "ring" : "allgather") +
         (k.split == SeqSplit::kContiguous ? " contiguous" : " zigzag") + (k.overlap ? "" : " no-overlap") +
         (k.recompute == Recompute::kBlock ? " recompute" : "") + (k.tied ? " tied" : "") + (k.gqa ? " gqa" : " mha");
}

class SpParity : public ::testing::TestWithParam<Exchange> {
 protected:
  Case base() const {
    Case k;
    k.exchange = GetParam();
    return k;
  }
  void run(const Case& k) {
    SCOPED_TRACE(name_of(k));
    check_parity(k);
  }
};

TEST_P(SpParity, ZigzagGqaUntiedOverlap) { run(base()); }

TEST_P(SpParity, Contiguous) {
  Case k = base();
  k.split = SeqSplit::kContiguous;
  run(k);
}

TEST_P(SpParity, TiedEmbeddings) {
  Case k = base();
  k.tied = true;
  run(k);
}

TEST_P(SpParity, MultiHeadAttention) {
  Case k = base();
  k.gqa = false;
  run(k);
}

TEST_P(SpParity, OverlapOff) {
  Case k = base();
  k.overlap = false;
  run(k);
  k.split = SeqSplit::kContiguous;
  run(k);
}

TEST_P(SpParity, RecomputeBlocks) {
  Case k = base();
  k.recompute = Recompute::kBlock;
  run(k);
  k.split = SeqSplit::kContiguous;
  k.overlap = false;
  k.tied = true;
  k.gqa = false;
  run(k);
}

TEST_P(SpParity, OneLayerOneSequence) {
  Case k = base();
  k.layers = 1;
  k.batch = 1;
  k.seq = 24;
  run(k);
}

TEST_P(SpParity, RankWithOnlyIgnoredTargets) {
  // The mean runs over the valid tokens of the whole global batch, counted across ranks.
  Case k = base();
  k.ignore_rank0 = true;
  run(k);
}

TEST_P(SpParity, GradientsAccumulateOverSteps) {
  // Two steps without zeroing: only each step's partial is summed over the axis, so the
  // gradients are twice one step's (a second all-reduce of everything would give 1 + S_).
  Case k = base();
  const Reference ref = reference(k);
  std::unique_ptr<ShardedModel> model = make_model(k, ref.config);
  const Batch local = model->local_batch(ref.global);
  auto be = make_cpu_backend();
  ASSERT_TRUE(model->forward_backward(*be, local, 0).ok());
  ASSERT_TRUE(model->forward_backward(*be, local, 0).ok());
  expect_grads(*model, ref, 2.0, "two steps");
  ASSERT_TRUE(model->forward_backward(*be, local, 0).ok());
  expect_grads(*model, ref, 3.0, "three steps");
  model->zero_grads();
  ASSERT_TRUE(model->forward_backward(*be, local, 0).ok());
  expect_grads(*model, ref, 1.0, "after zero_grads");
}

INSTANTIATE_TEST_SUITE_P(Exchanges, SpParity, ::testing::Values(Exchange::kAllGather, Exchange::kRing),
                         [](const ::testing::TestParamInfo<Exchange>& i) {
                           return std::string(i.param == Exchange::kRing ? "Ring" : "AllGather");
                         });

// ---- the ring attention pieces alone, as TP x SP will call them ----

Tensor random_global(const Shape& shape, uint64_t stream) {
  Tensor t = Tensor::empty(shape, DType::kF32, MemCategory::kWorkspace);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(normal_at(5, stream, i));
  return t;
}

// Rows `pos` of dim 1 of a [B, S, ...] tensor: [B, |pos|, ...].
Tensor rows_of(const Tensor& x, const std::vector<int32_t>& pos) {
  const int64_t B = x.dim(0), S = x.dim(1), row = x.numel() / (B * S), n = static_cast<int64_t>(pos.size());
  Shape shape = x.shape();
  shape[1] = n;
  Tensor out = Tensor::empty(shape, DType::kF32, MemCategory::kWorkspace);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(x.data<float>() + (b * S + pos[i]) * row, row, out.data<float>() + (b * n + i) * row);
  return out;
}

// lse [B, n, S] -> the columns `pos`: [B, n, |pos|].
Tensor lse_cols(const Tensor& lse, const std::vector<int32_t>& pos) {
  const int64_t B = lse.dim(0), n = lse.dim(1), S = lse.dim(2), m = static_cast<int64_t>(pos.size());
  Tensor out = Tensor::empty({B, n, m}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t r = 0; r < B * n; ++r)
    for (int64_t i = 0; i < m; ++i) out.data<float>()[r * m + i] = lse.data<float>()[r * S + pos[i]];
  return out;
}

void check_ring(SeqSplit split, bool overlap) {
  Communicator& world = test::mpi().world();
  const int N = world.size(), p = world.rank();
  const int64_t B = 2, S = 24 * N, n_h = 6, n_kv = 2, d = 8;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const Tensor q = random_global({B, S, n_h, d}, 1), k = random_global({B, S, n_kv, d}, 2),
               v = random_global({B, S, n_kv, d}, 3), d_out = random_global({B, S, n_h, d}, 4);
  auto be = make_cpu_backend();
  // Reference: the whole sequence on one rank.
  Tensor pos_all = Tensor::empty({S}, DType::kI32, MemCategory::kWorkspace);
  for (int64_t i = 0; i < S; ++i) pos_all.data<int32_t>()[i] = static_cast<int32_t>(i);
  Tensor out = Tensor::empty(q.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({B, n_h, S}, DType::kF32, MemCategory::kWorkspace);
  const AttentionArgs all{&q, &k, &v, &pos_all, &pos_all, scale};
  be->attention_forward(all, out, lse);
  Tensor dq = Tensor::empty(q.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor dk = Tensor::empty(k.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor dv = Tensor::empty(v.shape(), DType::kF32, MemCategory::kWorkspace);
  be->attention_backward(all, out, lse, d_out, dq, dk, dv);

  // This rank's rows through the ring.
  Result<SequenceShard> shard = SequenceShard::create(S, N, p, split);
  ASSERT_TRUE(shard.ok());
  const std::vector<int32_t>& mine = shard->positions();
  const std::vector<int32_t> gathered = shard->gathered_positions();
  Tensor q_pos = Tensor::empty({static_cast<int64_t>(mine.size())}, DType::kI32, MemCategory::kWorkspace);
  Tensor k_pos = Tensor::empty({S}, DType::kI32, MemCategory::kWorkspace);
  std::copy(mine.begin(), mine.end(), q_pos.data<int32_t>());
  std::copy(gathered.begin(), gathered.end(), k_pos.data<int32_t>());
  const Tensor lq = rows_of(q, mine), lk = rows_of(k, mine), lv = rows_of(v, mine), ldo = rows_of(d_out, mine);
  double waited = 0;
  RingAttentionArgs a;
  a.axis = &world;
  a.backend = be.get();
  a.q = &lq;
  a.k = &lk;
  a.v = &lv;
  a.q_pos = &q_pos;
  a.k_pos = &k_pos;
  a.scale = scale;
  a.overlap = overlap;
  a.wait_seconds = &waited;
  Tensor l_out = Tensor::empty(lq.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor l_lse = Tensor::empty({B, n_h, static_cast<int64_t>(mine.size())}, DType::kF32, MemCategory::kWorkspace);
  ring_attention_forward(a, l_out, l_lse);
  Tensor l_dq = Tensor::empty(lq.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor l_dk = Tensor::empty(lk.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor l_dv = Tensor::empty(lv.shape(), DType::kF32, MemCategory::kWorkspace);
  ring_attention_backward(a, l_out, l_lse, ldo, l_dq, l_dk, l_dv);

  const struct {
    const char* name;
    Tensor got, want;
  } checks[] = {{"out", l_out, rows_of(out, mine)},  {"lse", l_lse, lse_cols(lse, mine)},
                {"dq", l_dq, rows_of(dq, mine)},     {"dk", l_dk, rows_of(dk, mine)},
                {"dv", l_dv, rows_of(dv, mine)}};
  for (const auto& ch : checks)
    EXPECT_LE(max_rel_error(ch.got, ch.want), tol::kF32Parallel)
        << ch.name << " on rank " << p << "\n" << describe_mismatches(ch.got, ch.want, tol::kF32Parallel);
  EXPECT_GE(waited, 0.0);
}

TEST(RingAttention, MatchesAttentionOverTheWholeSequence) {
  for (SeqSplit split : {SeqSplit::kZigzag, SeqSplit::kContiguous})
    for (bool overlap : {true, false}) {
      SCOPED_TRACE(std::string(split == SeqSplit::kZigzag ? "zigzag" : "contiguous") + (overlap ? "" : " no-overlap"));
      check_ring(split, overlap);
    }
}

// ---- sizes that do not divide, and the factory ----

TEST(SpErrors, SequenceThatDoesNotSplit) {
  Communicator& world = test::mpi().world();
  const int D = world.size();
  const LlamaConfig c = test_config(false, true, 1);
  auto message = [&](int64_t seq, SeqSplit split) {
    LayoutOptions o;
    o.split = split;
    Result<std::unique_ptr<ShardedModel>> m = make_sp_sharded_model(c, world, seq, o);
    return m.ok() ? std::string("ok") : m.status().message();
  };
  const std::string zigzag = message(2 * D + 1, SeqSplit::kZigzag);
  EXPECT_NE(zigzag.find("sequence length (" + std::to_string(2 * D + 1) + ")"), std::string::npos) << zigzag;
  EXPECT_NE(zigzag.find("(2 x " + std::to_string(D) + " = " + std::to_string(2 * D) + ")"), std::string::npos)
      << zigzag;
  EXPECT_EQ(message(2 * D, SeqSplit::kZigzag), "ok");
  if (D > 1) {
    const std::string contiguous = message(D + 1, SeqSplit::kContiguous);
    EXPECT_NE(contiguous.find("sequence length (" + std::to_string(D + 1) + ")"), std::string::npos) << contiguous;
    EXPECT_NE(contiguous.find("sequence degree (" + std::to_string(D) + ")"), std::string::npos) << contiguous;
  }
  EXPECT_EQ(message(D, SeqSplit::kContiguous), "ok");
}

TEST(SpErrors, LocalBatchOfTheWrongLength) {
  Communicator& world = test::mpi().world();
  const LlamaConfig c = test_config(false, true, 1);
  const int64_t S = 8 * world.size();
  Result<std::unique_ptr<ShardedModel>> m = make_sp_sharded_model(c, world, S, LayoutOptions{});
  ASSERT_TRUE(m.ok());
  (*m)->init_weights(kInit);
  auto be = make_cpu_backend();
  const Batch global = synthetic_batch(c, 1, S, 3);
  Result<StepResult> r = (*m)->forward_backward(*be, global, 0);  // the global batch, not this rank's rows
  if (world.size() == 1) {
    EXPECT_TRUE(r.ok());
  } else {
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("SP shard holds " + std::to_string(S / world.size())), std::string::npos)
        << r.status().message();
  }
}

TEST(SpLayout, TheFactoryBuildsSpForAnSpMesh) {
  Communicator& world = test::mpi().world();
  const std::string layout = "sp=" + std::to_string(world.size());
  Result<Mesh> mesh = Mesh::create(world, layout);
  ASSERT_TRUE(mesh.ok()) << mesh.status().to_string();
  Result<std::unique_ptr<ShardedModel>> m =
      make_sharded_model(test_config(false, true, 1), *mesh, 8 * world.size(), LayoutOptions{});
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ((*m)->layout(), layout);
}

}  // namespace
}  // namespace foldpar
