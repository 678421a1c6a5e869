// TSP against the single-rank model (its reference): every rank builds the global weights
// and batch from one seed, computes the single-rank loss, logits and gradients, runs the
// TSP step on its shards and tokens, and compares its logits rows and the assembled
// gradients; and with bf16 storage against the single-rank model in bf16 (TspBf16Parity).
// Run under mpirun at 1, 2, 3 and 4 ranks (D = the world size).
#include <gtest/gtest.h>

#include "app/synthetic.h"
#include "backend/bf16_storage_backend.h"
#include "core/tolerance.h"
#include "mpi_test_main.h"
#include "parallel/tsp/tsp_model.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

// Sizes that divide for D = 1, 2, 4 (GQA g = 2, two KV heads per rank at D = 4, so head
// buckets can be tested) and a second config for D = 3.
LlamaConfig test_config(int D, bool tied, bool gqa) {
  LlamaConfig c;
  if (D == 3) {
    c.hidden_size = 48;            // d = 8
    c.num_attention_heads = 6;
    c.num_key_value_heads = gqa ? 3 : 6;
    c.intermediate_size = 72;
    c.vocab_size = 99;
  } else {
    c.hidden_size = 128;           // d = 8
    c.num_attention_heads = 16;
    c.num_key_value_heads = gqa ? 8 : 16;
    c.intermediate_size = 160;
    c.vocab_size = 128;
  }
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 1024;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

// The Hugging Face attention variants (model/llama_config.h): none, Qwen2's q/k/v biases,
// Llama's attention_bias (q/k/v and o biases), Qwen3's per-head q/k RMSNorm; Llama's
// mlp_bias (gate/up/down biases) alone and with attention_bias.
enum class Variant { kNone, kQwen2, kAttentionBias, kQwen3, kMlpBias, kAllBiases };

void apply_variant(Variant v, LlamaConfig& c) {
  c.qkv_bias = v == Variant::kQwen2 || v == Variant::kAttentionBias || v == Variant::kAllBiases;
  c.o_bias = v == Variant::kAttentionBias || v == Variant::kAllBiases;
  c.qk_norm = v == Variant::kQwen3;
  c.mlp_bias = v == Variant::kMlpBias || v == Variant::kAllBiases;
}

// The replicated variants (biases, q/k norm gains) among the Hugging Face tensor names.
bool is_variant(const std::string& name) {
  return name.ends_with("_proj.bias") || (name.find("self_attn") != std::string::npos && name.ends_with("_norm.weight"));
}

struct Case {
  Layout options;  // tsp is set to the world size
  bool tied = false;
  bool gqa = true;
  int64_t batch = 1;
  int64_t seq = 48;
  int layers = 2;
  bool ignore_rank0 = false;  // every target of rank 0's tokens is ignored
  Variant variant = Variant::kNone;
  int64_t head_dim = 0;  // > 0: head_dim independent of hidden_size / heads (qwen3)
  int64_t window = 0;    // LlamaConfig::sliding_window
  int64_t kv_heads = 0;  // > 0: num_key_value_heads (fewer than D: KV replicas)
};

// Weights with std 0.1 so that attention is far from uniform and every path matters.
const InitOptions kInit{.seed = 7, .std = 0.1, .norm_jitter = 0.2};

// KV replicas (n_kv < D): every rank's wk/wv gradient rows, not only the group's first (which
// assemble_global reads), equal the reference rows of its KV head, and every member of a
// group holds bit-identical rows.
void check_kv_replicas(Communicator& world, const ShardDims& dm, ShardedWeights& tg, LlamaWeights& ref_g) {
  const int D = world.size(), p = world.rank();
  const int64_t n = 2 * dm.kv_rows * dm.h;
  for (size_t l = 0; l < tg.attn.size(); ++l) {
    const Tensor rows = kv_replica_rows(dm, tg.attn[l]);
    const int64_t r0 = dm.kv_head0(p) * dm.d;
    const Tensor want_k = ref_g.layers[l].wk.narrow(r0, r0 + dm.kv_rows);
    const Tensor want_v = ref_g.layers[l].wv.narrow(r0, r0 + dm.kv_rows);
    EXPECT_LE(max_rel_error(rows.narrow(0, dm.kv_rows), want_k), tol::kF32Parallel) << "wk replica, rank " << p;
    EXPECT_LE(max_rel_error(rows.narrow(dm.kv_rows, 2 * dm.kv_rows), want_v), tol::kF32Parallel)
        << "wv replica, rank " << p;
    Tensor all = Tensor::empty({D, n}, DType::kF32, MemCategory::kWorkspace);
    ASSERT_TRUE(world.all_gather(rows.raw_data(), all.raw_data(), static_cast<size_t>(n), DType::kF32).ok());
    const Tensor first = all.narrow(dm.kv_group_first(p), dm.kv_group_first(p) + 1);
    EXPECT_EQ(max_rel_error(all.narrow(p, p + 1), first), 0.0) << "layer " << l << ": rank " << p
                                                               << "'s replica differs from rank "
                                                               << dm.kv_group_first(p) << "'s";
  }
}

void check_parity(const Case& k) {
  Communicator& world = test::mpi().world();
  const int D = world.size(), p = world.rank();
  LlamaConfig c = test_config(D, k.tied, k.gqa);
  c.num_hidden_layers = k.layers;
  apply_variant(k.variant, c);
  if (k.head_dim > 0) c.explicit_head_dim = k.head_dim;
  c.sliding_window = k.window;
  if (k.kv_heads > 0) c.num_key_value_heads = k.kv_heads;

  // The reference: the single-rank model on the same seed.
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  Batch global = synthetic_batch(c, k.batch, k.seq, 11, 0.1);
  if (k.ignore_rank0) {
    for (int32_t pos : shard_positions(k.seq, D, 0, k.options.split))
      for (int64_t b = 0; b < k.batch; ++b) global.target_ids.data<int32_t>()[b * k.seq + pos] = kIgnoreIndex;
  }
  auto be = make_cpu_backend();
  LlamaWeights ref_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  StepOptions so;
  so.keep_logits = true;
  Result<StepResult> ref = model_forward_backward(c, *be, w, global, so, ref_g);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();

  // TSP on this rank's shards (initialized on their own, as in training) and tokens.
  Layout opt = k.options;
  opt.tsp = D;
  opt.keep_logits = true;
  Result<TspModel> model = TspModel::create(c, opt, p, k.seq);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ShardedWeights tw = ShardedWeights::allocate(c, model->dims(), p, DType::kF32, MemCategory::kParameters);
  init_sharded_weights(kInit, tw);
  ShardedWeights tg = ShardedWeights::allocate(c, model->dims(), p, DType::kF32, MemCategory::kGradients);
  tg.zero();
  const Batch local = model->shard().local_batch(global);
  Result<StepResult> got = model->forward_backward(*be, world, tw, local, tg);
  ASSERT_TRUE(got.ok()) << got.status().to_string();

  // f32, different summation order (shards accumulate the output, ranks sum gradients):
  // observed errors are near 1e-6; kF32Parallel leaves a margin of 10.
  EXPECT_EQ(got->valid_tokens, ref->valid_tokens);
  EXPECT_NEAR(got->loss, ref->loss, tol::kF32Parallel * ref->loss);
  // Logits of this rank's rows.
  Tensor ref_rows = Tensor::empty(got->logits.shape(), DType::kF32, MemCategory::kWorkspace);
  const std::vector<int32_t>& pos = model->shard().positions();
  for (int64_t b = 0; b < k.batch; ++b)
    for (size_t i = 0; i < pos.size(); ++i)
      std::copy_n(ref->logits.data<float>() + (b * k.seq + pos[i]) * c.vocab_size, c.vocab_size,
                  ref_rows.data<float>() + (b * static_cast<int64_t>(pos.size()) + static_cast<int64_t>(i)) * c.vocab_size);
  const double logit_err = max_rel_error(got->logits, ref_rows);
  EXPECT_LE(logit_err, tol::kF32Parallel) << "logits of rank " << p;
  // Every gradient, assembled from every rank's shards.
  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(assemble_global(tg, world, assembled).ok());
  std::vector<std::pair<std::string, Tensor>> ref_list;
  ref_g.for_each([&](const std::string& n, Tensor& t) { ref_list.emplace_back(n, t); });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    const double err = max_rel_error(t, ref_list[i++].second);
    EXPECT_LE(err, tol::kF32Parallel) << name << " on rank " << p << "\n"
                                      << describe_mismatches(t, ref_list[i - 1].second, tol::kF32Parallel);
  });
  // The replicated variants' gradients are complete on every rank, not only on rank 0 (which
  // assemble_global reads): each rank's own copies against the reference.
  LlamaWeights own_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  own_g.zero();
  unshard_into_global(tg, /*replicated=*/true, own_g);
  size_t variants = 0;
  i = 0;
  own_g.for_each([&](const std::string& name, Tensor& t) {
    const Tensor& want = ref_list[i++].second;
    if (!is_variant(name)) return;
    ++variants;
    EXPECT_LE(max_rel_error(t, want), tol::kF32Parallel) << name << " held by rank " << p << "\n"
                                                         << describe_mismatches(t, want, tol::kF32Parallel);
  });
  EXPECT_EQ(static_cast<int64_t>(variants),
            c.num_hidden_layers * ((c.qkv_bias ? 3 : 0) + (c.o_bias ? 1 : 0) + (c.qk_norm ? 2 : 0) + (c.mlp_bias ? 3 : 0)));
  // The shards initialized on their own equal the slices of the global weights.
  ShardedWeights sliced = ShardedWeights::allocate(c, model->dims(), p, DType::kF32, MemCategory::kWorkspace);
  shard_from_global(w, sliced);
  std::vector<Tensor> own;
  tw.for_each([&](const std::string&, Tensor& t, bool) { own.push_back(t); });
  size_t j = 0;
  sliced.for_each([&](const std::string& name, Tensor& t, bool) { EXPECT_EQ(max_rel_error(own[j++], t), 0.0) << name; });
  if (model->dims().replicated_kv()) check_kv_replicas(world, model->dims(), tg, ref_g);
}

TEST(TspParity, ZigzagGqaUntiedOverlap) { check_parity(Case{}); }

// One rank holds the whole sequence, in order, whatever the split: an odd S is no zigzag
// (validate_layout refuses it only where the sequence is cut; dp=2,tsp=1 used to abort).
TEST(TspParity, OneRankTakesAnOddSequence) {
  if (test::mpi().world().size() != 1) GTEST_SKIP() << "an odd S divides over one rank only";
  Case k;
  k.seq = 33;
  check_parity(k);
}

// Mistral's sliding window (issue 21): the mask is on global positions, so the zigzag and the
// contiguous shards get it from their position arrays. Windows under one rank's chunk, odd,
// and across a chunk boundary. (Not 1: each query would see only itself, the q and k
// gradients would be exactly 0 and the parity would compare rounding noise; the kernel test
// covers window 1.)
TEST(TspParity, SlidingWindow) {
  for (int64_t window : {2, 5, 17}) {
    Case k;
    k.window = window;
    check_parity(k);
  }
  Case contiguous;
  contiguous.window = 7;
  contiguous.options.split = SeqSplit::kContiguous;
  check_parity(contiguous);
}

TEST(TspParity, Contiguous) {
  Case k;
  k.options.split = SeqSplit::kContiguous;
  check_parity(k);
}

TEST(TspParity, TiedEmbeddings) {
  Case k;
  k.tied = true;
  check_parity(k);
}

TEST(TspParity, MultiHeadAttention) {
  Case k;
  k.gqa = false;
  check_parity(k);
}

TEST(TspParity, OverlapOff) {
  Case k;
  k.options.overlap = false;
  check_parity(k);
}

TEST(TspParity, HeadBuckets) {
  Case k;
  const int D = test::mpi().world().size();
  // Two KV heads per rank at D = 4 (8 / 4); more elsewhere.
  k.options.head_buckets = D == 3 ? 1 : 2;
  k.gqa = true;
  check_parity(k);
  k.options.overlap = false;
  check_parity(k);
}

TEST(TspParity, KeepWeightsAndKv) {
  Case k;
  k.options.keep_weights = true;
  k.options.keep_kv = true;
  check_parity(k);
}

TEST(TspParity, RecomputeBlocks) {
  Case k;
  k.options.recompute = Recompute::kBlock;
  check_parity(k);
}

TEST(TspParity, OneLayerBatchTwo) {
  Case k;
  k.layers = 1;
  k.batch = 2;
  k.tied = true;
  check_parity(k);
}

TEST(TspParity, RankWithOnlyIgnoredTargets) {
  // The mean runs over the valid tokens of the whole sequence, counted across ranks.
  Case k;
  k.ignore_rank0 = true;
  check_parity(k);
}

// The attention variants: each shard's bias slices on its heads' projections of the local
// tokens, the o bias once per token, the q/k norms per head before RoPE; their gradients
// summed over the axis (checked on every rank above).
TEST(TspParity, Qwen2QkvBiases) {
  Case k;
  k.variant = Variant::kQwen2;
  check_parity(k);
}

TEST(TspParity, LlamaAttentionBiasWithBucketsAndNoOverlap) {
  Case k;
  k.variant = Variant::kAttentionBias;
  check_parity(k);
  k.options.head_buckets = test::mpi().world().size() == 3 ? 1 : 2;
  k.options.overlap = false;
  k.tied = true;
  check_parity(k);
}

TEST(TspParity, Qwen3QkNorms) {
  Case k;
  k.variant = Variant::kQwen3;
  check_parity(k);
  k.options.head_buckets = test::mpi().world().size() == 3 ? 1 : 2;
  k.options.keep_weights = true;
  k.options.keep_kv = true;
  check_parity(k);
  k = Case{};
  k.variant = Variant::kQwen3;
  k.options.recompute = Recompute::kBlock;
  k.gqa = false;
  k.batch = 2;
  k.head_dim = 12;
  check_parity(k);
}

// Llama's mlp_bias: each ring step's chunk takes its owner's columns' gate/up bias slices, the
// down bias rides in step 0's chunk (once per token); the gradients, over the local tokens,
// are summed over the axis with the attention variants' (checked on every rank above). With
// the attention biases, head buckets, no overlap, tied embeddings, kept weights, recompute.
TEST(TspParity, LlamaMlpBias) {
  const int D = test::mpi().world().size();
  Case k;
  k.variant = Variant::kMlpBias;
  check_parity(k);
  k.variant = Variant::kAllBiases;
  k.options.head_buckets = D == 3 ? 1 : 2;
  k.options.overlap = false;
  k.tied = true;
  check_parity(k);
  k = Case{};
  k.variant = Variant::kAllBiases;
  k.options.keep_weights = true;
  k.options.recompute = Recompute::kBlock;
  k.kv_heads = 1;
  k.batch = 2;
  check_parity(k);
}

// Fewer KV heads than ranks (issue 21): n_kv = 1 (every rank one replica) and, at D = 4,
// n_kv = 2 (groups of two), in the schedules that treat K/V differently: overlap on and off,
// the contiguous split, kept weights and K/V, block recompute, Qwen2's q/k/v biases and the
// q/k norms (their k-side gradients come once per group). At D = 1 n_kv = 1 is plain MQA.
TEST(TspParity, FewerKvHeadsThanRanks) {
  const int D = test::mpi().world().size();
  Case k;
  k.kv_heads = 1;
  check_parity(k);
  k = Case{};
  k.kv_heads = D == 4 ? 2 : 1;
  k.options.overlap = false;
  k.options.split = SeqSplit::kContiguous;
  k.variant = Variant::kQwen2;
  check_parity(k);
  k = Case{};
  k.kv_heads = 1;
  k.options.keep_weights = true;
  k.options.keep_kv = true;
  k.options.recompute = Recompute::kBlock;
  k.variant = Variant::kQwen3;
  k.tied = true;
  check_parity(k);
}

// KV replicas with head buckets: a rank's buckets split its query heads and share its one KV
// head; the group's first unit gathers K/V, its last reduce-scatters the summed dK/dV. With
// overlap on and off, kept K/V, recompute, and the q/k/v biases (the k/v bias once per group).
TEST(TspParity, FewerKvHeadsThanRanksWithHeadBuckets) {
  const int D = test::mpi().world().size();
  const int nb = D == 1 ? 1 : 2;  // D = 1: one KV head is no replica, and one bucket holds it
  Case k;
  k.kv_heads = 1;
  k.options.head_buckets = nb;
  check_parity(k);
  k.options.overlap = false;
  k.options.head_buckets = D == 2 ? 4 : nb;  // 8 query heads per rank at D = 2
  k.variant = Variant::kQwen2;
  check_parity(k);
  k = Case{};
  k.kv_heads = D == 4 ? 2 : 1;
  k.options.head_buckets = nb;
  k.options.keep_kv = true;
  k.options.recompute = Recompute::kBlock;
  k.variant = Variant::kAllBiases;
  check_parity(k);
}

// bf16 storage (train --bf16): weights, activations and what travels (shards, K/V) in
// bf16 through the storage decorator, gradients f32, against the single-rank model in bf16
// with the same weights, under megatron_parity_test.cc's rules (its "bf16 storage" section
// derives them): the loss within one bf16 ulp (2^-8 relative), every assembled gradient, and
// every rank's own copy of the replicated variants, within 16 ulp normwise.
constexpr double kBf16Ulp = 1.0 / 256;

void check_bf16_parity(const Case& k) {
  Communicator& world = test::mpi().world();
  const int D = world.size(), p = world.rank();
  LlamaConfig c = test_config(D, k.tied, k.gqa);
  c.num_hidden_layers = k.layers;
  apply_variant(k.variant, c);
  if (k.kv_heads > 0) c.num_key_value_heads = k.kv_heads;
  auto cpu = make_cpu_backend();
  auto bf = make_bf16_storage_backend(*cpu);
  LlamaWeights w = LlamaWeights::allocate(c, DType::kBF16, MemCategory::kParameters);
  init_weights(kInit, w);
  const Batch global = synthetic_batch(c, k.batch, k.seq, 11, 0.1);
  LlamaWeights ref_g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  Result<StepResult> ref = model_forward_backward(c, *bf, w, global, StepOptions{}, ref_g);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();

  Layout opt = k.options;
  opt.tsp = D;
  opt.dtype = DType::kBF16;
  Result<TspModel> model = TspModel::create(c, opt, p, k.seq);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ShardedWeights tw = ShardedWeights::allocate(c, model->dims(), p, DType::kBF16, MemCategory::kParameters);
  init_sharded_weights(kInit, tw);
  ShardedWeights tg = ShardedWeights::allocate(c, model->dims(), p, DType::kF32, MemCategory::kGradients);
  tg.zero();
  Result<StepResult> got = model->forward_backward(*bf, world, tw, model->shard().local_batch(global), tg);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->valid_tokens, ref->valid_tokens);
  EXPECT_NEAR(got->loss, ref->loss, kBf16Ulp * ref->loss);
  LlamaWeights assembled = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  ASSERT_TRUE(assemble_global(tg, world, assembled).ok());
  LlamaWeights own = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  own.zero();
  unshard_into_global(tg, /*replicated=*/true, own);  // this rank's replicated copies
  std::vector<Tensor> want, mine;
  ref_g.for_each([&](const std::string&, Tensor& t) { want.push_back(t); });
  own.for_each([&](const std::string&, Tensor& t) { mine.push_back(t); });
  size_t i = 0;
  assembled.for_each([&](const std::string& name, Tensor& t) {
    const double tol = 16 * kBf16Ulp;
    EXPECT_LE(max_rel_error(t, want[i]), tol) << name << " on rank " << p << "\n" << describe_mismatches(t, want[i], tol);
    if (is_variant(name)) {
      EXPECT_EQ(max_rel_error(mine[i], t), 0.0) << name << ": rank " << p << "'s copy differs from rank 0's";
    }
    ++i;
  });
  if (model->dims().replicated_kv()) {
    // Every member of a KV group holds the group's wk/wv gradient bit for bit.
    const ShardDims& dm = model->dims();
    for (size_t l = 0; l < tg.attn.size(); ++l) {
      const Tensor rows = kv_replica_rows(dm, tg.attn[l]);
      Tensor all = Tensor::empty({D, rows.numel()}, DType::kF32, MemCategory::kWorkspace);
      ASSERT_TRUE(world.all_gather(rows.raw_data(), all.raw_data(), static_cast<size_t>(rows.numel()), DType::kF32).ok());
      const int first = dm.kv_group_first(p);
      EXPECT_EQ(max_rel_error(all.narrow(p, p + 1), all.narrow(first, first + 1)), 0.0) << "layer " << l << " rank " << p;
    }
  }
}

// The plain model, then each attention variant (bf16 biases and gains, replicated; their
// gradients f32 and summed over the axis) and KV replicas (one KV head), with head buckets,
// kept weights and K/V, and block recompute in turn.
TEST(TspBf16Parity, PlainVariantsAndKvReplicasMatchTheSingleRankBf16Model) {
  const int D = test::mpi().world().size();
  check_bf16_parity(Case{});
  Case k;
  k.variant = Variant::kQwen2;
  k.options.head_buckets = D == 3 ? 1 : 2;
  check_bf16_parity(k);
  k = Case{};
  k.variant = Variant::kAttentionBias;
  k.tied = true;
  k.options.keep_weights = true;
  k.options.keep_kv = true;
  check_bf16_parity(k);
  k = Case{};
  k.variant = Variant::kQwen3;
  k.options.recompute = Recompute::kBlock;
  check_bf16_parity(k);
  k = Case{};
  k.variant = Variant::kAttentionBias;
  k.kv_heads = 1;
  k.options.overlap = false;
  check_bf16_parity(k);
  k = Case{};
  k.variant = Variant::kAllBiases;
  k.options.head_buckets = D == 3 ? 1 : 2;
  check_bf16_parity(k);
  if (D > 1) {  // KV replicas with head buckets
    k = Case{};
    k.kv_heads = 1;
    k.options.head_buckets = 2;
    check_bf16_parity(k);
  }
}

TEST(TspErrors, SizesThatDoNotDivide) {
  const int D = test::mpi().world().size();
  if (D == 1) GTEST_SKIP() << "everything divides by 1";
  LlamaConfig c = test_config(D, false, true);
  auto message = [&](const LlamaConfig& cfg, int64_t seq, Layout o = {}) {
    o.tsp = D;
    Result<TspModel> m = TspModel::create(cfg, o, 0, seq);
    return m.ok() ? std::string("ok") : m.status().message();
  };
  LlamaConfig bad = c;
  bad.num_attention_heads = D * 4 + 1;
  bad.num_key_value_heads = 1;
  bad.hidden_size = bad.num_attention_heads * 2;
  EXPECT_NE(message(bad, 48).find("num_attention_heads (" + std::to_string(D * 4 + 1) + ")"), std::string::npos);
  bad = c;
  bad.intermediate_size = D * 10 + 1;
  EXPECT_NE(message(bad, 48).find("intermediate_size"), std::string::npos);
  bad = c;
  bad.vocab_size = D * 10 + 1;
  EXPECT_NE(message(bad, 48).find("vocab_size"), std::string::npos);
  EXPECT_NE(message(c, 2 * D + 1).find("sequence length (" + std::to_string(2 * D + 1) + ")"), std::string::npos);
  Layout o;
  o.head_buckets = 3;
  EXPECT_NE(message(c, 48, o).find("head buckets (3)"), std::string::npos);
  if (D == 4) {  // 3 KV heads neither divide by 4 nor divide it
    bad = c;
    bad.num_key_value_heads = 3;
    bad.num_attention_heads = 12;
    bad.hidden_size = 96;
    EXPECT_NE(message(bad, 48).find("num_key_value_heads (3) must be divisible by the TSP degree (4)"),
              std::string::npos);
  }
  // KV replicas with head buckets: the buckets must divide the query heads per rank (2, 4 or 8 here).
  bad = c;
  bad.num_key_value_heads = 1;
  o.head_buckets = 3;
  EXPECT_NE(message(bad, 48, o).find("head buckets (3) must divide the query heads per TSP rank"), std::string::npos)
      << message(bad, 48, o);
  o.head_buckets = 2;
  EXPECT_EQ(message(bad, 48, o), "ok");
}

}  // namespace
}  // namespace foldpar
