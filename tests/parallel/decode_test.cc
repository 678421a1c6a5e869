// Generation under tsp=D and tp=D against the single-rank model (docs/tsp.md section 6), at D = the
// world size (1, 2, 3, 4), mixture-of-experts models on tsp=D included (D = 1, 2, 4):
//  - parity: the logits of the prefill and of every decode step equal the logits of one
//    full forward over the same tokens, for prompts of awkward lengths (some ranks hold none
//    of a short prompt's tokens), every TSP prefill option, GQA and MHA, tied embeddings;
//  - greedy generations equal the single-rank model's greedy continuation token for token;
//  - traffic: a decode step moves exactly the documented O(h) bytes per layer and no
//    weight byte (no broadcast, reduce or point-to-point);
//  - memory: the KV cache holds 2*L*B*S*h*4/(g*D) bytes per rank (tracked allocator) and
//    stays balanced across ranks as tokens are decoded;
//  - generate() counts the completions' tokens apart from the decoded slots;
//  - errors name the numbers.
#include <gtest/gtest.h>

#include "comm/comm_stats.h"
#include "comm/mesh.h"
#include "core/rng.h"
#include "core/tolerance.h"
#include "decode_reference.h"
#include "data/tokenizer.h"
#include "mpi_test_main.h"
#include "infer/generator.h"
#include "parallel/make_layout.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

// Sizes that divide for D = 1, 2, 4 (g = 2, two KV heads per rank at D = 4) and for D = 3.
LlamaConfig test_config(int D, bool gqa, bool tied) {
  LlamaConfig c;
  if (D == 3) {
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
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 1024;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

// std 0.1: attention far from uniform, and clear margins between the top logits (greedy).
const InitOptions kInit{.seed = 7, .std = 0.1, .norm_jitter = 0.2};

using test::random_tokens;
using test::reference_logits;

struct Case {
  LlamaConfig config;
  std::string layout = "tsp";  // "tsp" or "tp"; the degree is the world size
  Layout options;              // the knobs; the axis comes from `layout`
};

// A decoder of the layout on the whole world, with the counter-based weights.
struct Built {
  std::unique_ptr<Mesh> mesh;
  std::unique_ptr<ShardedDecoder> decoder;
};
Built build(const Case& s) {
  Communicator& world = test::mpi().world();
  Built b;
  Layout layout = s.options;
  const Layout axis = parse_layout(s.layout + "=" + std::to_string(world.size())).value();
  layout.strategy = axis.strategy;
  layout.tsp = axis.tsp;
  layout.tp = axis.tp;
  Result<Mesh> mesh = Mesh::create(world, layout.mesh());
  FP_CHECK_OK(mesh.status());
  b.mesh = std::make_unique<Mesh>(std::move(mesh).value());
  Result<std::unique_ptr<ShardedDecoder>> d = make_sharded_decoder(s.config, *b.mesh, layout);
  FP_CHECK_OK(d.status());
  b.decoder = std::move(d).value();
  b.decoder->init_weights(kInit);
  return b;
}

// The logits row of sequence b in `got` [B, V] against row `pos` of the reference [n, V].
void expect_row(const Tensor& got, int64_t b, const Tensor& ref, int64_t pos, const std::string& what) {
  const int64_t V = got.dim(1);
  const Tensor g = got.narrow(b, b + 1).reshape({V}), r = ref.narrow(pos, pos + 1).reshape({V});
  // f32 in a different summation order (partial attentions combined across ranks, GEMV
  // against GEMM blocking, all-reduced partial projections): observed up to 1.7e-6 at D = 1-4.
  EXPECT_LE(max_rel_error(g, r), tol::kF32Parallel)
      << what << ", sequence " << b << ", position " << pos << " on rank " << test::mpi().world().rank() << "\n"
      << describe_mismatches(g, r, tol::kF32Parallel);
}

// Prompts of lengths 5, 13 and 1, fed 6 fixed tokens each (teacher forcing): the prefill's
// and every decode step's logits against one full forward of each whole sequence.
void check_parity(const Case& s) {
  const LlamaConfig& c = s.config;
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  const std::vector<int64_t> lengths{5, 13, 1};
  const int64_t fed = 6, B = static_cast<int64_t>(lengths.size());
  std::vector<std::vector<int32_t>> prompts, full;
  std::vector<Tensor> ref;
  for (int64_t b = 0; b < B; ++b) {
    full.push_back(random_tokens(c, lengths[b] + fed, static_cast<uint64_t>(b)));
    prompts.emplace_back(full.back().begin(), full.back().begin() + lengths[b]);
    ref.push_back(reference_logits(c, w, full.back()));
  }
  Built m = build(s);
  auto be = make_cpu_backend();
  Result<Tensor> logits = m.decoder->prefill(*be, prompts, fed);
  ASSERT_TRUE(logits.ok()) << logits.status().to_string();
  for (int64_t b = 0; b < B; ++b) expect_row(*logits, b, ref[b], lengths[b] - 1, "prefill");
  for (int64_t t = 0; t < fed; ++t) {
    std::vector<int32_t> tokens;
    for (int64_t b = 0; b < B; ++b) tokens.push_back(full[b][lengths[b] + t]);
    logits = m.decoder->decode(*be, tokens);
    ASSERT_TRUE(logits.ok()) << logits.status().to_string();
    for (int64_t b = 0; b < B; ++b) expect_row(*logits, b, ref[b], lengths[b] + t, "decode step " + std::to_string(t));
  }
  for (int64_t b = 0; b < B; ++b) EXPECT_EQ(m.decoder->sequence_length(b), lengths[b] + fed);
}

Case make_case(const std::string& layout, bool gqa = true, bool tied = false) {
  return Case{test_config(test::mpi().world().size(), gqa, tied), layout, {}};
}

TEST(DecodeParity, TspZigzagGqa) { check_parity(make_case("tsp")); }
TEST(DecodeParity, TspContiguous) {
  Case s = make_case("tsp");
  s.options.split = SeqSplit::kContiguous;
  check_parity(s);
}
TEST(DecodeParity, TspMhaTiedNoOverlap) {
  Case s = make_case("tsp", false, true);
  s.options.overlap = false;
  check_parity(s);
}
TEST(DecodeParity, TspHeadBuckets) {
  Case s = make_case("tsp", false);  // MHA: 4 KV heads per rank at D = 4, 2 at D = 3
  s.options.head_buckets = 2;
  if (s.config.num_key_value_heads / test::mpi().world().size() % 2 != 0) GTEST_SKIP() << "KV heads per rank odd";
  check_parity(s);
}
TEST(DecodeParity, TpGqa) { check_parity(make_case("tp")); }
// tp:seqpar decodes as tp (the prefill runs plain tp over the same weight shards).
TEST(DecodeParity, TpSequenceParallelDecodesAsTp) {
  Case s = make_case("tp");
  s.options.sequence_parallel = true;
  check_parity(s);
}

// Fewer KV heads than ranks (issue 21): each rank's query heads read its replica of one KV
// head; the TSP cache keeps every KV head once per token, the tp cache the rank's replica.
TEST(DecodeParity, OneKvHeadOnTspAndTp) {
  for (const char* layout : {"tsp", "tp"}) {
    Case s = make_case(layout);
    s.config.num_key_value_heads = 1;
    SCOPED_TRACE(std::string(layout) + " n_kv 1");
    check_parity(s);
  }
  // The TSP prefill with head buckets sharing each rank's replica (D > 1: one KV head is no
  // replica on one rank, where it cannot split into buckets).
  if (test::mpi().world().size() == 1) return;
  Case s = make_case("tsp");
  s.config.num_key_value_heads = 1;
  s.options.head_buckets = 2;
  SCOPED_TRACE("tsp n_kv 1, 2 head buckets");
  check_parity(s);
}
// head_dim apart from h / n_h (12 and 4 with h / n_h = 8): q width n_h * d above and below h.
TEST(DecodeParity, HeadDimApartFromHiddenOnTspAndTp) {
  for (const char* layout : {"tsp", "tp"})
    for (int64_t d : {12, 4}) {
      Case s = make_case(layout);
      s.config.explicit_head_dim = d;
      SCOPED_TRACE(std::string(layout) + " head_dim " + std::to_string(d));
      check_parity(s);
    }
}

// RoPE scaling is all in the tables: each decode step's table (its one position) rotates as
// the full forward's does, yarn's attention factor included. (Dynamic is left out: its
// frequencies depend on the sequence length, which grows during decode, as in Hugging Face.)
TEST(DecodeParity, RopeScaledLlama3AndYarnOnTspAndTp) {
  for (const char* layout : {"tsp", "tp"})
    for (RopeScaling::Type type : {RopeScaling::Type::kLlama3, RopeScaling::Type::kYarn}) {
      Case s = make_case(layout);
      s.config.rope_scaling.type = type;
      s.config.rope_scaling.factor = type == RopeScaling::Type::kYarn ? 4.0 : 8.0;
      s.config.rope_scaling.original_max_position_embeddings = type == RopeScaling::Type::kYarn ? 16 : 64;
      SCOPED_TRACE(std::string(layout) + " " + rope_type_name(type));
      check_parity(s);
    }
}
// Mistral's sliding window (issue 21): prefill and every decode step attend only to the
// cached keys within the window, as the full windowed forward does. Window 4 is shorter than
// the prompts of 5 and 13 and than every fed sequence.
TEST(DecodeParity, SlidingWindowOnTspAndTp) {
  for (const char* layout : {"tsp", "tp"}) {
    Case s = make_case(layout);
    s.config.sliding_window = 4;
    check_parity(s);
  }
}

TEST(DecodeParity, TpMhaTied) { check_parity(make_case("tp", false, true)); }

// The Hugging Face attention variants (issue 21): q/k/v biases (qwen2), q/k/v/o biases
// (llama attention_bias), per-head q/k norms with head_dim 12 != h / n_h (qwen3): the TSP and
// tp prefill and every decode step against the single-rank full forward, at every world size.
TEST(DecodeParity, AttentionBiasesAndQkNormsOnTspAndTp) {
  for (const char* layout : {"tsp", "tp"})
    for (int variant = 0; variant < 3; ++variant) {
      Case s = make_case(layout);
      s.config.qkv_bias = true;
      s.config.o_bias = variant >= 1;
      s.config.qk_norm = variant == 2;
      if (variant == 2) s.config.explicit_head_dim = 12;
      SCOPED_TRACE(std::string(layout) + " variant " + std::to_string(variant));
      check_parity(s);
    }
}

// Llama's mlp_bias (alone, and with attention_bias): each rank's columns' gate/up bias slices,
// the down bias once after the sum, in the prefill and every decode step.
TEST(DecodeParity, MlpBiasOnTspAndTp) {
  for (const char* layout : {"tsp", "tp"})
    for (bool attention_bias : {false, true}) {
      Case s = make_case(layout);
      s.config.mlp_bias = true;
      s.config.qkv_bias = s.config.o_bias = attention_bias;
      SCOPED_TRACE(std::string(layout) + (attention_bias ? " with attention_bias" : ""));
      check_parity(s);
    }
}

// Mixture-of-experts models (4 experts, top 2): Mixtral-like, and Qwen2-MoE-like with a shared
// expert and a dense layer between the sparse ones. Each decode step routes the new tokens
// through the router and every rank's experts (decode_block.h); the prefill is TSP's forward
// under each dispatch scheme. E = 4 divides over D = 1, 2 and 4 only.
LlamaConfig moe_decode_config(MoeFamily family) {
  LlamaConfig c = test_config(2, true, false);  // h 128, 16 heads, 8 KV heads, V 128
  MoeConfig& m = c.moe;
  m.family = family;
  m.num_experts = 4;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = 48;
  m.norm_topk_prob = family != MoeFamily::kQwen2;
  if (family == MoeFamily::kQwen2) {
    c.num_hidden_layers = 3;
    m.shared_expert_intermediate_size = 32;
    m.mlp_only_layers = {1};
  }
  return c;
}

TEST(DecodeParity, MixtureOfExpertsOnTsp) {
  const int D = test::mpi().world().size();
  if (4 % D != 0) GTEST_SKIP() << "4 experts do not divide over " << D << " ranks";
  const std::pair<MoeFamily, Layout::MoeDispatchOption> cases[] = {
      {MoeFamily::kMixtral, Layout::MoeDispatchOption::kAllToAll},
      {MoeFamily::kQwen2, Layout::MoeDispatchOption::kGather},
      {MoeFamily::kMixtral, Layout::MoeDispatchOption::kRing}};
  for (const auto& [family, dispatch] : cases) {
    Case s{moe_decode_config(family), "tsp", {}};
    s.options.moe_dispatch = dispatch;
    SCOPED_TRACE(std::string(family == MoeFamily::kQwen2 ? "qwen2_moe" : "mixtral") + " prefill dispatch " +
                 std::to_string(static_cast<int>(dispatch)));
    check_parity(s);
  }
}

// tp=N: the experts spread over the tp ranks as in training (parallel/megatron/tp_moe.cc);
// prefill and decode route every row on every rank and sum the ranks' experts over tp. At 2
// and 4 ranks (E = 4 divides), and E = 2 at 4 ranks (each expert split over two).
TEST(DecodeParity, MixtureOfExpertsOnTp) {
  const int D = test::mpi().world().size();
  if (4 % D != 0) GTEST_SKIP() << "4 experts do not divide over " << D << " ranks";
  for (MoeFamily family : {MoeFamily::kMixtral, MoeFamily::kQwen2}) {
    SCOPED_TRACE(family == MoeFamily::kQwen2 ? "qwen2_moe" : "mixtral");
    check_parity(Case{moe_decode_config(family), "tp", {}});
  }
  if (D == 4) {
    LlamaConfig c = moe_decode_config(MoeFamily::kQwen2);
    c.moe.num_experts = 2;
    c.moe.num_experts_per_tok = 2;
    SCOPED_TRACE("E=2 over tp=4");
    check_parity(Case{c, "tp", {}});
  }
}

// A MoE model with one KV head (a replica on every rank at D > 1): the TSP prefill's KV
// replicas and the decode step's attention on the replica, with each dispatch; and with
// experts split over ranks (D > E).
TEST(DecodeParity, MixtureOfExpertsWithOneKvHead) {
  const int D = test::mpi().world().size();
  if (4 % D != 0) GTEST_SKIP() << "4 experts do not divide over " << D << " ranks";
  for (Layout::MoeDispatchOption dispatch : {Layout::MoeDispatchOption::kAllToAll, Layout::MoeDispatchOption::kGather,
                                             Layout::MoeDispatchOption::kRing}) {
    LlamaConfig c = moe_decode_config(dispatch == Layout::MoeDispatchOption::kGather ? MoeFamily::kQwen2
                                                                                      : MoeFamily::kMixtral);
    c.num_key_value_heads = 1;
    if (D > 1 && dispatch == Layout::MoeDispatchOption::kRing) c.moe.num_experts = c.moe.num_experts_per_tok = D / 2;
    Case s{c, "tsp", {}};
    s.options.moe_dispatch = dispatch;
    SCOPED_TRACE("one KV head, E=" + std::to_string(c.moe.num_experts) + ", prefill dispatch " +
                 std::to_string(static_cast<int>(dispatch)));
    check_parity(s);
  }
}

// D > E: E = D/2 experts (k = E), each split over two ranks (an f_e slice each): the decode
// step's all_reduce sums an expert's slices as it sums the ranks' experts.
TEST(DecodeParity, MixtureOfExpertsSplitOverRanks) {
  const int D = test::mpi().world().size();
  if (D != 2 && D != 4) GTEST_SKIP() << "runs at 2 and 4 ranks (the config's heads divide by those)";
  for (Layout::MoeDispatchOption dispatch : {Layout::MoeDispatchOption::kAllToAll, Layout::MoeDispatchOption::kGather,
                                             Layout::MoeDispatchOption::kRing}) {
    LlamaConfig c = moe_decode_config(MoeFamily::kQwen2);
    c.moe.num_experts = D / 2;
    c.moe.num_experts_per_tok = D / 2;
    Case s{c, "tsp", {}};
    s.options.moe_dispatch = dispatch;
    SCOPED_TRACE("E=" + std::to_string(D / 2) + " prefill dispatch " + std::to_string(static_cast<int>(dispatch)));
    check_parity(s);
  }
}

// Greedy decoding: each chosen token is the argmax of the logits (lowest id on ties).
int32_t argmax_row(const Tensor& logits, int64_t b) {
  const int64_t V = logits.dim(1);
  const float* row = logits.data<float>() + b * V;
  return static_cast<int32_t>(std::max_element(row, row + V) - row);
}

// The single-rank greedy continuation: a full forward per new token.
std::vector<int32_t> reference_greedy(const LlamaConfig& c, const LlamaWeights& w, std::vector<int32_t> tokens,
                                      int64_t n) {
  std::vector<int32_t> out;
  for (int64_t t = 0; t < n; ++t) {
    const Tensor logits = reference_logits(c, w, tokens);
    const int32_t next = argmax_row(logits.narrow(logits.dim(0) - 1, logits.dim(0)), 0);
    out.push_back(next);
    tokens.push_back(next);
  }
  return out;
}

void check_greedy(const LlamaConfig& c, const std::vector<std::string>& layouts) {
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  const std::vector<std::vector<int32_t>> prompts{random_tokens(c, 9, 20), random_tokens(c, 3, 21)};
  const int64_t n = 12;
  std::vector<std::vector<int32_t>> want;
  for (const auto& p : prompts) want.push_back(reference_greedy(c, w, p, n));
  for (const std::string& layout : layouts) {
    Built m = build(Case{c, layout, {}});
    auto be = make_cpu_backend();
    Result<Tensor> logits = m.decoder->prefill(*be, prompts, n);
    ASSERT_TRUE(logits.ok()) << logits.status().to_string();
    std::vector<std::vector<int32_t>> got(prompts.size());
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int32_t> tokens;
      for (size_t b = 0; b < prompts.size(); ++b) tokens.push_back(argmax_row(*logits, static_cast<int64_t>(b)));
      for (size_t b = 0; b < prompts.size(); ++b) got[b].push_back(tokens[b]);
      if (t + 1 < n) {
        logits = m.decoder->decode(*be, tokens);
        ASSERT_TRUE(logits.ok()) << logits.status().to_string();
      }
    }
    for (size_t b = 0; b < prompts.size(); ++b) EXPECT_EQ(got[b], want[b]) << layout << " sequence " << b;
  }
}

TEST(DecodeGreedy, EqualsSingleRankOnEveryLayout) {
  check_greedy(test_config(test::mpi().world().size(), true, false), {"tsp", "tp"});
}

TEST(DecodeGreedy, MixtureOfExpertsEqualsSingleRankOnTspAndTp) {
  const int D = test::mpi().world().size();
  if (4 % D != 0) GTEST_SKIP() << "4 experts do not divide over " << D << " ranks";
  check_greedy(moe_decode_config(MoeFamily::kMixtral), {"tsp", "tp"});
  check_greedy(moe_decode_config(MoeFamily::kQwen2), {"tsp", "tp"});
}

// generate(): the report counts what the model computed (every slot of every decode step,
// finished sequences included) apart from what the user got (the completions' tokens).
TEST(DecodeGenerate, CountsGeneratedTokensApartFromDecodedSlots) {
  Communicator& world = test::mpi().world();
  const LlamaConfig c = test_config(world.size(), true, false);  // V = 99 or 128: ASCII prompts
  Built m = build(Case{c, "tsp", {}});
  auto be = make_cpu_backend();
  const std::unique_ptr<Tokenizer> bytes = make_byte_tokenizer();
  const std::vector<std::string> prompts{"ab", "AB C"};
  GenerationOptions o;
  o.max_new_tokens = 10;  // greedy (temperature 0)
  Result<GenerationReport> all = generate(*m.decoder, *be, *bytes, prompts, o, world);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  EXPECT_EQ(all->decode_tokens, 2 * (o.max_new_tokens - 1));  // the last token needs no decode step
  // Stop sequence 0 after its first two tokens: its slot keeps being decoded while sequence
  // 1 runs on, but it gets no more tokens. Rank 0 holds the completions: it tells the others.
  int32_t first_two[2] = {0, 0};
  if (world.rank() == 0) {
    EXPECT_EQ(all->generated_tokens, 2 * o.max_new_tokens);
    ASSERT_GE(all->completions[0].tokens.size(), 2u);
    std::copy_n(all->completions[0].tokens.begin(), 2, first_two);
  }
  ASSERT_TRUE(world.broadcast(first_two, 2, DType::kI32, 0).ok());
  o.stop = {bytes->decode(std::span<const int32_t>(first_two, 2))};
  Result<GenerationReport> cut = generate(*m.decoder, *be, *bytes, prompts, o, world);
  ASSERT_TRUE(cut.ok()) << cut.status().to_string();
  if (world.rank() != 0) return;
  int64_t given = 0, longest = 0;
  for (const Completion& done : cut->completions) {
    given += static_cast<int64_t>(done.tokens.size());
    longest = std::max(longest, static_cast<int64_t>(done.tokens.size()));
  }
  EXPECT_EQ(cut->completions[0].stop_reason, "stop");
  EXPECT_LE(cut->completions[0].tokens.size(), 2u);
  EXPECT_EQ(cut->generated_tokens, given);
  EXPECT_EQ(cut->decode_tokens, 2 * (longest - 1));
  // Sequence 0's slot ran `longest` steps too, but only its own tokens count.
  EXPECT_LT(cut->generated_tokens, 2 * longest);
}

// ---- traffic ----

// What one decode step of B sequences moves per rank, by operation kind, in bytes (elements
// x 4), from the formulas in parallel/decode_block.h, tsp/tsp_decoder.cc and megatron/megatron_decoder.cc.
struct StepFormula {
  uint64_t all_reduce_calls = 0, all_reduce_bytes = 0;
  uint64_t all_gather_calls = 0, all_gather_bytes = 0;
  uint64_t all_to_all_calls = 0, all_to_all_bytes = 0;
};
StepFormula step_formula(const LlamaConfig& c, const std::string& layout, uint64_t D, uint64_t B) {
  const uint64_t h = c.hidden_size, g = c.group(), V = c.vocab_size, L = c.num_hidden_layers,
                 n_h = c.num_attention_heads;
  StepFormula f;
  f.all_reduce_calls = 1 + 2 * L;  // embedding, then o_proj and down_proj of every layer
  f.all_reduce_bytes = 4 * (1 + 2 * L) * 2 * B * h * (D - 1) / D;
  f.all_gather_calls = 1;  // the logits
  f.all_gather_bytes = 4 * B * V * (D - 1) / D;
  if (layout == "tsp") {
    // [q | k | v] of every rank's heads: 2h/g K/V values per token, or with KV replicas
    // (n_kv < D) each rank's one KV head, 2 d D values.
    const uint64_t n_kv = c.num_key_value_heads, kv = n_kv < D ? 2 * c.head_dim() * D : 2 * h / g;
    f.all_gather_calls += L;
    f.all_gather_bytes += 4 * L * B * (h + kv) * (D - 1) / D;
    f.all_to_all_calls = L;  // (partial output, lse) of every head
    f.all_to_all_bytes = 4 * L * B * (h + n_h) * (D - 1) / D;
  }
  return f;
}

TEST(DecodeTraffic, StepMovesTheDocumentedBytesAndNoWeights) {
  Communicator& world = test::mpi().world();
  const uint64_t D = static_cast<uint64_t>(world.size());
  for (const int64_t kv_heads : {0, 1})
  for (const std::string layout : {"tsp", "tp"}) {
    Case s = make_case(layout);
    if (kv_heads > 0) s.config.num_key_value_heads = kv_heads;  // KV replicas at D > 1
    SCOPED_TRACE(layout + " n_kv " + std::to_string(s.config.num_key_value_heads));
    Built m = build(s);
    auto be = make_cpu_backend();
    const std::vector<std::vector<int32_t>> prompts{random_tokens(s.config, 7, 1), random_tokens(s.config, 2, 2)};
    ASSERT_TRUE(m.decoder->prefill(*be, prompts, 3).ok());
    for (int step = 0; step < 3; ++step) {
      ScopedCommCounter counter(m.mesh->communicators());
      ASSERT_TRUE(m.decoder->decode(*be, std::vector<int32_t>{3, 4}).ok());
      const CommStats got = counter.delta();
      const StepFormula f = step_formula(s.config, layout, D, 2);
      const std::string what = layout + " step " + std::to_string(step);
      EXPECT_EQ(got.op(CommOpKind::kAllReduce).calls, f.all_reduce_calls) << what;
      EXPECT_EQ(got.op(CommOpKind::kAllReduce).bytes_sent, f.all_reduce_bytes) << what;
      EXPECT_EQ(got.op(CommOpKind::kAllGather).calls, f.all_gather_calls) << what;
      EXPECT_EQ(got.op(CommOpKind::kAllGather).bytes_sent, f.all_gather_bytes) << what;
      EXPECT_EQ(got.op(CommOpKind::kAllToAll).calls, f.all_to_all_calls) << what;
      EXPECT_EQ(got.op(CommOpKind::kAllToAll).bytes_sent, f.all_to_all_bytes) << what;
      // Nothing else: weights would move by broadcast (TSP attention), send_recv (the MLP and
      // vocabulary rings) or reduce; none runs during decode.
      const uint64_t total_calls = f.all_reduce_calls + f.all_gather_calls + f.all_to_all_calls;
      EXPECT_EQ(got.total().calls, total_calls) << what << "\n" << got.to_string();
      EXPECT_EQ(got.total().bytes_sent, f.all_reduce_bytes + f.all_gather_bytes + f.all_to_all_bytes) << what;
      EXPECT_EQ(got.total().bytes_received, got.total().bytes_sent) << what;
    }
  }
}

// ---- memory ----

TEST(DecodeMemory, CacheBytesMatchTheFormulaAndStayBalanced) {
  Communicator& world = test::mpi().world();
  const int64_t D = world.size(), p = world.rank();
  for (const std::string layout : {"tsp", "tp"}) {
    Case s = make_case(layout);
    const LlamaConfig& c = s.config;
    // B = 2 prompts of n tokens (a multiple of 2D: zigzag holds n/D real tokens per rank) and
    // m new ones, S = n + m a multiple of D.
    const int64_t B = 2, n = D == 3 ? 12 : 8, m = D == 3 ? 6 : 8, S = n + m;
    Built built = build(s);
    auto be = make_cpu_backend();
    MemoryTracker& mt = MemoryTracker::process();
    const int64_t before = mt.stats().current_of(MemCategory::kKvCache);
    ASSERT_TRUE(built.decoder->prefill(*be, {random_tokens(c, n, 5), random_tokens(c, n, 6)}, m).ok());
    const int64_t cache = mt.stats().current_of(MemCategory::kKvCache) - before;
    const int64_t L = c.num_hidden_layers, h = c.hidden_size, g = c.group();
    EXPECT_EQ(cache, 2 * L * B * S * h * 4 / (g * D)) << layout << " on rank " << p;
    EXPECT_EQ(cache, built.decoder->cache().bytes()) << layout;
    for (int64_t t = 0; t < m; ++t) ASSERT_TRUE(built.decoder->decode(*be, std::vector<int32_t>{1, 2}).ok());
    // Full and balanced: under TSP every rank holds S/D tokens of each sequence.
    for (int64_t b = 0; b < B; ++b)
      EXPECT_EQ(built.decoder->cache().length(b), layout == "tsp" ? S / D : S) << layout << " sequence " << b;
    EXPECT_EQ(mt.stats().current_of(MemCategory::kKvCache) - before, cache) << "the cache never grows";
  }
}

// ---- errors ----

TEST(DecodeErrors, NameTheProblem) {
  Case s = make_case("tsp");
  Built m = build(s);
  auto be = make_cpu_backend();
  auto message = [](const Status& st) { return st.to_string(); };
  Result<Tensor> r = m.decoder->decode(*be, std::vector<int32_t>{1});
  EXPECT_NE(message(r.status()).find("before prefill"), std::string::npos) << message(r.status());
  r = m.decoder->prefill(*be, {{1, 2}, {}}, 4);
  EXPECT_NE(message(r.status()).find("prompt 1 has no tokens"), std::string::npos) << message(r.status());
  r = m.decoder->prefill(*be, {{1, static_cast<int32_t>(s.config.vocab_size)}}, 4);
  EXPECT_NE(message(r.status()).find("outside the vocabulary"), std::string::npos) << message(r.status());
  r = m.decoder->prefill(*be, {{1, 2}}, s.config.max_position_embeddings);
  EXPECT_NE(message(r.status()).find("exceeds max_position_embeddings (1024)"), std::string::npos)
      << message(r.status());
  ASSERT_TRUE(m.decoder->prefill(*be, {{1, 2}, {3}}, 1).ok());
  r = m.decoder->decode(*be, std::vector<int32_t>{1});
  EXPECT_NE(message(r.status()).find("1 tokens for 2 sequences"), std::string::npos) << message(r.status());
  ASSERT_TRUE(m.decoder->decode(*be, std::vector<int32_t>{1, 2}).ok());
  r = m.decoder->decode(*be, std::vector<int32_t>{1, 2});
  EXPECT_NE(message(r.status()).find("beyond the 1 new tokens"), std::string::npos) << message(r.status());

  Communicator& world = test::mpi().world();
  LlamaConfig odd = s.config;
  odd.num_key_value_heads = 1;
  odd.num_attention_heads = 1;
  odd.hidden_size = 16;
  Result<Mesh> mesh = Mesh::create(world, "tsp=" + std::to_string(world.size()));
  ASSERT_TRUE(mesh.ok());
  if (world.size() > 1) {
    Result<std::unique_ptr<ShardedDecoder>> d = make_sharded_decoder(odd, *mesh, tsp_layout(world.size()));
    EXPECT_NE(message(d.status()).find("num_attention_heads (1) must be divisible by the TSP degree"), std::string::npos)
        << message(d.status());
  }
  // No decoder stores bf16 weights or a bf16 cache.
  for (const std::string bf16 : {"tsp", "tp"}) {
    const Layout lo = parse_layout(bf16 + "=" + std::to_string(world.size()) + ":bf16").value();
    Result<Mesh> lm = Mesh::create(world, lo.mesh());
    ASSERT_TRUE(lm.ok());
    Result<std::unique_ptr<ShardedDecoder>> d = make_sharded_decoder(s.config, *lm, lo);
    EXPECT_EQ(d.status().code(), StatusCode::kUnimplemented) << lo.to_string();
    EXPECT_NE(message(d.status()).find("bf16 is not implemented"), std::string::npos) << message(d.status());
  }
  if (world.size() == 1) return;  // sp=1 is one rank of the Megatron layout: tp=1 generates
  const Layout sp_layout = parse_layout("sp=" + std::to_string(world.size())).value();
  Result<Mesh> sp = Mesh::create(world, sp_layout.mesh());
  ASSERT_TRUE(sp.ok());
  Result<std::unique_ptr<ShardedDecoder>> d = make_sharded_decoder(s.config, *sp, sp_layout);
  EXPECT_EQ(d.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(message(d.status()).find("tsp=N or tp=N"), std::string::npos) << message(d.status());
}

}  // namespace
}  // namespace foldpar
