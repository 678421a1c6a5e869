// Generation under pp (parallel/pipeline/pipeline_decoder.h) against the single-rank model:
//  - parity: the prefill's and every decode step's logits equal one full forward over the same
//    tokens (teacher forcing), for prompts of different lengths, B >= p (groups of unequal
//    size) and B < p (one sequence per group), tied and untied embeddings;
//  - greedy: the generated tokens equal the single-rank decoder's (tsp=1 on one rank) token
//    for token, and so do its logits;
//  - the stage holds only its layers' KV cache, and the prefill and each decode step move
//    one padded activation per group across each boundary (counted on pp);
//  - the attention variants and KV replicas (issue 21) alike;
//  - decoding with groups in flight (decode_in_flight: the sampler inside the pipeline)
//    chooses the same tokens from the same logits as the step-by-step loop, greedy and
//    seeded sampling, with sequences finishing at different steps;
//  - layouts not implemented are refused by name.
// Layouts by world size: pp=2,tsp=1 with even and uneven (3/1) stages and pp=2,tp=1 (2
// ranks); pp=2,tsp=2, pp=4,tsp=1 and tp stages pp=2,tp=2 and pp=2,tp=2:seqpar (4 ranks; tp
// stages hold every token and the cache sharded by heads, as TpDecoder; seqpar decodes as tp).
#include <gtest/gtest.h>

#include "comm/comm_stats.h"
#include "comm/mesh.h"
#include "core/rng.h"
#include "core/tolerance.h"
#include "decode_reference.h"
#include "infer/sampler.h"
#include "mpi_test_main.h"
#include "parallel/make_layout.h"
#include "parallel/pipeline/pipeline_decoder.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

// n_h 8, n_kv 4 (g = 2): divisible by D = 2; L = 4 layers, so pp=4 holds one each.
LlamaConfig test_config(bool tied) {
  LlamaConfig c;
  c.hidden_size = 64;  // d = 8
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.intermediate_size = 96;
  c.vocab_size = 64;
  c.num_hidden_layers = 4;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

// std 0.1: attention far from uniform, clear margins between the top logits (greedy).
const InitOptions kInit{.seed = 7, .std = 0.1, .norm_jitter = 0.2};

using test::random_tokens;
using test::reference_logits;

struct Built {
  std::unique_ptr<Mesh> mesh;
  std::unique_ptr<ShardedDecoder> decoder;
};

Built build(Communicator& comm, const LlamaConfig& c, const std::string& layout) {
  Built b;
  const Layout lo = parse_layout(layout).value();
  Result<Mesh> mesh = Mesh::create(comm, lo.mesh());
  FP_CHECK_OK(mesh.status());
  b.mesh = std::make_unique<Mesh>(std::move(mesh).value());
  Result<std::unique_ptr<ShardedDecoder>> d = make_sharded_decoder(c, *b.mesh, lo);
  FP_CHECK_OK(d.status());
  b.decoder = std::move(d).value();
  b.decoder->init_weights(kInit);
  return b;
}

// The layouts of this world size.
std::vector<std::string> layouts() {
  switch (test::mpi().world().size()) {
    case 2: return {"pp=2,tsp=1", "pp=2,tsp=1:stages=3/1", "pp=2,tp=1"};
    case 4: return {"pp=2,tsp=2", "pp=4,tsp=1", "pp=2,tp=2", "pp=2,tp=2:seqpar"};
    default: return {};
  }
}

// Row b of got [B, V] against row `pos` of ref [n, V].
void expect_row(const Tensor& got, int64_t b, const Tensor& ref, int64_t pos, const std::string& what) {
  const int64_t V = got.dim(1);
  const Tensor g = got.narrow(b, b + 1).reshape({V}), r = ref.narrow(pos, pos + 1).reshape({V});
  // The decoders' own rule (tests/parallel/decode_test.cc): f32 summed in another order.
  EXPECT_LE(max_rel_error(g, r), tol::kF32Parallel)
      << what << ", sequence " << b << ", position " << pos << " on rank " << test::mpi().world().rank() << "\n"
      << describe_mismatches(g, r, tol::kF32Parallel);
}

// Prompts of `lengths`, fed `fed` fixed tokens each: the prefill's and every decode step's
// logits against one full forward of each whole sequence; the cache and the boundary traffic.
void check_parity(const std::string& layout, const std::vector<int64_t>& lengths, const LlamaConfig& c) {
  SCOPED_TRACE(layout + " B " + std::to_string(lengths.size()) + (c.tie_word_embeddings ? " tied" : ""));
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(kInit, w);
  const int64_t fed = 3, B = static_cast<int64_t>(lengths.size());
  std::vector<std::vector<int32_t>> prompts, full;
  std::vector<Tensor> ref;
  for (int64_t b = 0; b < B; ++b) {
    full.push_back(random_tokens(c, lengths[b] + fed, static_cast<uint64_t>(b)));
    prompts.emplace_back(full.back().begin(), full.back().begin() + lengths[b]);
    ref.push_back(reference_logits(c, w, full.back()));
  }
  Built m = build(test::mpi().world(), c, layout);
  const Layout lo = parse_layout(layout).value();
  const int s = m.mesh->coord("pp"), P = lo.pp;
  const std::vector<int64_t> groups = decode_groups(B, P);
  int64_t widest = 0;
  for (size_t g = 0; g + 1 < groups.size(); ++g) widest = std::max(widest, groups[g + 1] - groups[g]);
  const uint64_t sends = s < P - 1 ? groups.size() - 1 : 0;  // one per group to the next stage

  auto be = make_cpu_backend();
  ScopedCommCounter prefill_counter(m.mesh->comm("pp"));
  Result<Tensor> logits = m.decoder->prefill(*be, prompts, fed);
  ASSERT_TRUE(logits.ok()) << logits.status().to_string();
  const CommStats prefill_pp = prefill_counter.delta();
  for (int64_t b = 0; b < B; ++b) expect_row(*logits, b, ref[b], lengths[b] - 1, "prefill");
  // Prefill: per group [widest * S/D, h] f32, S the longest prompt padded to 2D (zigzag)
  // under TSP; tp stages: [widest * S, h], S the longest prompt (every tp rank holds every token).
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end()), unit = 2 * lo.tsp;
  const int64_t local_seq =
      lo.strategy == Strategy::kTsp ? (longest + unit - 1) / unit * unit / lo.tsp : longest;
  EXPECT_EQ(prefill_pp.op(CommOpKind::kSend).calls, sends) << "stage " << s;
  EXPECT_EQ(prefill_pp.op(CommOpKind::kSend).bytes_sent, sends * widest * local_seq * c.hidden_size * 4)
      << "stage " << s;

  // The stage's cache holds its own layers only.
  const std::vector<int64_t> bounds = stage_bounds(c, lo);
  EXPECT_EQ(m.decoder->cache().layers(), bounds[s + 1] - bounds[s]) << "stage " << s;
  for (int64_t t = 0; t < fed; ++t) {
    std::vector<int32_t> tokens;
    for (int64_t b = 0; b < B; ++b) tokens.push_back(full[b][lengths[b] + t]);
    ScopedCommCounter counter(m.mesh->comm("pp"));
    logits = m.decoder->decode(*be, tokens);
    ASSERT_TRUE(logits.ok()) << logits.status().to_string();
    const CommStats pp = counter.delta();
    for (int64_t b = 0; b < B; ++b) expect_row(*logits, b, ref[b], lengths[b] + t, "decode step " + std::to_string(t));
    // One [widest, h] f32 message per group to the next stage; the logits' broadcast.
    EXPECT_EQ(pp.op(CommOpKind::kSend).calls, sends) << "stage " << s;
    EXPECT_EQ(pp.op(CommOpKind::kSend).bytes_sent, sends * widest * c.hidden_size * 4) << "stage " << s;
    EXPECT_EQ(pp.op(CommOpKind::kBroadcast).calls, 1u);
  }
  for (int64_t b = 0; b < B; ++b) EXPECT_EQ(m.decoder->sequence_length(b), lengths[b] + fed);
}

TEST(PipelineDecode, GroupsSplitTheBatch) {
  EXPECT_EQ(decode_groups(3, 2), (std::vector<int64_t>{0, 2, 3}));
  EXPECT_EQ(decode_groups(4, 2), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(decode_groups(1, 2), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(decode_groups(3, 4), (std::vector<int64_t>{0, 1, 2, 3}));
}

// B = 3 >= p = 2 (groups of 2 and 1), B = 3 < p = 4, B = 1 < p; prompts of 5, 13 and 1
// tokens (some TSP ranks hold none of the short prompt's tokens).
TEST(PipelineDecode, LogitsEqualFullForward) {
  if (layouts().empty()) GTEST_SKIP() << "no pp layout for " << test::mpi().world().size() << " ranks";
  for (const std::string& layout : layouts()) {
    check_parity(layout, {5, 13, 1}, test_config(false));
    check_parity(layout, {7}, test_config(true));
  }
}

// The attention variants, all at once (Qwen3 with attention_bias: q/k/v/o biases and the q/k
// norms, replicated on every rank), and one KV head (a replica of it on every TSP rank at
// D = 2): each stage applies its own layers' variants.
TEST(PipelineDecode, AttentionVariantsAndKvReplicas) {
  if (layouts().empty()) GTEST_SKIP() << "no pp layout for " << test::mpi().world().size() << " ranks";
  LlamaConfig c = test_config(true);
  c.qkv_bias = c.o_bias = c.qk_norm = true;
  c.num_key_value_heads = 1;
  for (const std::string& layout : layouts()) check_parity(layout, {5, 13, 1}, c);
}

// Mixture-of-experts models under pp on TSP and tp stages: each stage routes the new tokens
// through its own sparse layers (decode_block.h) and prefills with its strategy's forward of
// its layers (TSP: under the layout's dispatch; tp: the replicated form, every tp rank routing
// every row, so prompt lengths need not divide by tp). Mixtral-like (every layer sparse) and
// Qwen2-MoE-like (a shared expert, layer 1 dense); 4 experts, top 2, so E divides over D = 1
// and 2.
TEST(PipelineDecode, MixtureOfExpertsOnTspAndTpStages) {
  if (layouts().empty()) GTEST_SKIP() << "no pp layout for " << test::mpi().world().size() << " ranks";
  for (const MoeFamily family : {MoeFamily::kMixtral, MoeFamily::kQwen2}) {
    LlamaConfig c = test_config(false);
    MoeConfig& m = c.moe;
    m.family = family;
    m.num_experts = 4;
    m.num_experts_per_tok = 2;
    m.moe_intermediate_size = 48;
    m.norm_topk_prob = family != MoeFamily::kQwen2;
    if (family == MoeFamily::kQwen2) {
      m.shared_expert_intermediate_size = 32;
      m.mlp_only_layers = {1};
    }
    SCOPED_TRACE(family == MoeFamily::kQwen2 ? "qwen2_moe" : "mixtral");
    for (const std::string& layout : layouts()) {
      check_parity(layout, {5, 13, 1}, c);
      if (parse_layout(layout).value().tsp > 1) {
        check_parity(layout + ":moe=gather", {5, 13, 1}, c);
        check_parity(layout + ":moe=ring", {7}, c);
      }
    }
  }
}

int32_t argmax_row(const Tensor& logits, int64_t b) {
  const int64_t V = logits.dim(1);
  const float* row = logits.data<float>() + b * V;
  return static_cast<int32_t>(std::max_element(row, row + V) - row);
}

// Greedy tokens (and every step's logits) of a decoder over prompts, n new tokens each.
std::vector<std::vector<int32_t>> greedy(ShardedDecoder& d, const std::vector<std::vector<int32_t>>& prompts, int64_t n,
                                         std::vector<Tensor>& step_logits) {
  auto be = make_cpu_backend();
  Result<Tensor> logits = d.prefill(*be, prompts, n);
  FP_CHECK_OK(logits.status());
  std::vector<std::vector<int32_t>> got(prompts.size());
  for (int64_t t = 0; t < n; ++t) {
    step_logits.push_back(*logits);
    std::vector<int32_t> tokens;
    for (size_t b = 0; b < prompts.size(); ++b) tokens.push_back(argmax_row(*logits, static_cast<int64_t>(b)));
    for (size_t b = 0; b < prompts.size(); ++b) got[b].push_back(tokens[b]);
    if (t + 1 < n) {
      logits = d.decode(*be, tokens);
      FP_CHECK_OK(logits.status());
    }
  }
  return got;
}

TEST(PipelineDecode, GreedyEqualsSingleRankDecoder) {
  if (layouts().empty()) GTEST_SKIP() << "no pp layout for " << test::mpi().world().size() << " ranks";
  Communicator& world = test::mpi().world();
  const LlamaConfig c = test_config(false);
  const std::vector<std::vector<int32_t>> prompts{random_tokens(c, 9, 20), random_tokens(c, 3, 21),
                                                  random_tokens(c, 6, 22)};
  const int64_t n = 6;
  // The single-rank decoder, on every rank alone.
  const std::unique_ptr<Communicator> self = world.split(world.rank(), 0, "self");
  const Built one = build(*self, c, "tsp=1");
  std::vector<Tensor> want_logits;
  const std::vector<std::vector<int32_t>> want = greedy(*one.decoder, prompts, n, want_logits);
  for (const std::string& layout : layouts()) {
    SCOPED_TRACE(layout);
    Built m = build(world, c, layout);
    std::vector<Tensor> got_logits;
    EXPECT_EQ(greedy(*m.decoder, prompts, n, got_logits), want);
    for (size_t t = 0; t < got_logits.size(); ++t)
      for (int64_t b = 0; b < static_cast<int64_t>(prompts.size()); ++b)
        expect_row(got_logits[t], b, want_logits[t], b, "greedy step " + std::to_string(t));
  }
}

// The tokens of a batch chosen step by step (decode calls, the sampler between them) or in
// flight, as the generator does: every unfinished sequence's next token (0 once finished)
// from its logits row, sequence b finishing after limits[b] tokens. Rank 0 records each
// chosen token and the logits row it came from.
struct Chosen {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<std::vector<float>>> rows;  // [b][step][V]
};

class Chooser {
 public:
  Chooser(const std::vector<int64_t>& limits, const SamplingOptions& sampling)
      : limits_(limits), sampling_(sampling), got_{std::vector<std::vector<int32_t>>(limits.size()),
                                                    std::vector<std::vector<std::vector<float>>>(limits.size())} {}
  // Sequences [b0, b0 + n): returns whether every sequence has finished.
  bool operator()(int64_t b0, const Tensor& logits, std::span<int32_t> out) {
    const int64_t V = logits.dim(1);
    for (int64_t j = 0; j < logits.dim(0); ++j) {
      const size_t b = static_cast<size_t>(b0 + j);
      out[static_cast<size_t>(j)] = 0;
      if (static_cast<int64_t>(got_.tokens[b].size()) >= limits_[b]) continue;
      const float* row = logits.data<float>() + j * V;
      const std::span<const float> r(row, static_cast<size_t>(V));
      out[static_cast<size_t>(j)] = sample_token(r, sampling_, b, got_.tokens[b].size());
      got_.tokens[b].push_back(out[static_cast<size_t>(j)]);
      got_.rows[b].emplace_back(row, row + V);
    }
    for (size_t b = 0; b < limits_.size(); ++b)
      if (static_cast<int64_t>(got_.tokens[b].size()) < limits_[b]) return false;
    return true;
  }
  const Chosen& got() const { return got_; }

 private:
  std::vector<int64_t> limits_;
  SamplingOptions sampling_;
  Chosen got_;
};

// Rank 0 chooses; the tokens (and the end) reach every rank by a broadcast, as the generator's.
Chosen run_chooser(ShardedDecoder& d, Mesh& mesh, const LlamaConfig& c, const std::vector<std::vector<int32_t>>& prompts,
                   const std::vector<int64_t>& limits, const SamplingOptions& sampling, bool in_flight) {
  Communicator* pp = &mesh.comm("pp");
  const int axis_rank = mesh.has_axis("tsp") ? mesh.coord("tsp") : mesh.has_axis("tp") ? mesh.coord("tp") : 0;
  const int64_t hidden = c.hidden_size, vocab = c.vocab_size;
  Communicator& world = test::mpi().world();
  auto be = make_cpu_backend();
  const int64_t B = static_cast<int64_t>(prompts.size());
  const int64_t most = *std::max_element(limits.begin(), limits.end());
  Result<Tensor> logits = d.prefill(*be, prompts, most);
  FP_CHECK_OK(logits.status());
  Chooser chooser(limits, sampling);
  std::vector<int32_t> tokens(static_cast<size_t>(B) + 1, 0);
  for (;;) {
    if (world.rank() == 0)
      tokens[static_cast<size_t>(B)] = chooser(0, *logits, std::span<int32_t>(tokens.data(), static_cast<size_t>(B)));
    FP_CHECK_OK(world.broadcast(tokens.data(), tokens.size(), DType::kI32, 0));
    if (tokens.back() != 0) break;
    const std::span<const int32_t> step(tokens.data(), static_cast<size_t>(B));
    if (in_flight) {
      ShardedDecoder::GroupChooser choose;
      if (world.rank() == 0) choose = std::ref(chooser);
      ScopedCommCounter counter(*pp);
      Result<int64_t> rows = d.decode_in_flight(*be, step, choose);
      FP_CHECK_OK(rows.status());
      EXPECT_GT(*rows, 0);
      // No collective over pp: each boundary carries one [widest + 1, h] f32 message per
      // group and step (the rows and the end flag), and the last stage's first rank sends
      // stage 0's first rank each group's logits [widest, V].
      const CommStats stats = counter.delta();
      EXPECT_EQ(stats.op(CommOpKind::kBroadcast).calls, 0u);
      const OpCounters& sends = stats.op(CommOpKind::kSend);
      const int64_t P = pp->size(), s = pp->rank(), widest = (B + P - 1) / P;
      const int64_t h = hidden;
      const bool first_rank = axis_rank == 0;
      if (s < P - 1) {
        EXPECT_GT(sends.calls, 0u);
        EXPECT_EQ(sends.bytes_sent, sends.calls * static_cast<uint64_t>((widest + 1) * h * 4));
      } else {
        EXPECT_EQ(sends.calls > 0, first_rank);
        EXPECT_EQ(sends.bytes_sent, sends.calls * static_cast<uint64_t>(widest * vocab * 4));
      }
      break;
    }
    logits = d.decode(*be, step);
    FP_CHECK_OK(logits.status());
  }
  return chooser.got();
}

TEST(PipelineDecode, InFlightChoosesWhatTheStepByStepLoopChooses) {
  if (layouts().empty()) GTEST_SKIP() << "no pp layout for " << test::mpi().world().size() << " ranks";
  Communicator& world = test::mpi().world();
  const LlamaConfig c = test_config(false);
  // B = 5 >= p: groups 3/2 at p = 2, 2/1/1/1 at p = 4; sequences end after 1 to 7 tokens.
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t b = 0; b < 5; ++b) prompts.push_back(random_tokens(c, 3 + 2 * b, static_cast<uint64_t>(40 + b)));
  const std::vector<int64_t> limits{7, 3, 1, 7, 5};
  SamplingOptions sampled;
  sampled.temperature = 0.9;
  sampled.top_k = 20;
  sampled.seed = 5;
  for (const std::string& layout : layouts()) {
    for (const SamplingOptions& sampling : {SamplingOptions{}, sampled}) {
      SCOPED_TRACE(layout + (sampling.temperature > 0 ? " sampled" : " greedy"));
      Built m = build(world, c, layout);
      ASSERT_TRUE(m.decoder->decodes_in_flight(5));
      const Chosen want = run_chooser(*m.decoder, *m.mesh, c, prompts, limits, sampling, false);
      const Chosen got = run_chooser(*m.decoder, *m.mesh, c, prompts, limits, sampling, true);
      if (world.rank() != 0) continue;
      for (size_t b = 0; b < limits.size(); ++b) {
        ASSERT_EQ(want.tokens[b].size(), static_cast<size_t>(limits[b])) << "sequence " << b;
        EXPECT_EQ(got.tokens[b], want.tokens[b]) << "sequence " << b;
        ASSERT_EQ(got.rows[b].size(), want.rows[b].size());
        // The same groups through the same stages: the same logits, bit for bit.
        for (size_t t = 0; t < got.rows[b].size(); ++t)
          EXPECT_EQ(got.rows[b][t], want.rows[b][t]) << "sequence " << b << " token " << t;
      }
      // The decoding has ended: decode waits for the next prefill.
      auto be = make_cpu_backend();
      EXPECT_FALSE(m.decoder->decode(*be, std::vector<int32_t>(5, 1)).ok());
    }
  }
}

TEST(PipelineDecode, InFlightNeedsAsManySequencesAsStages) {
  Communicator& world = test::mpi().world();
  if (world.size() != 4) GTEST_SKIP() << "pp=4 on 4 ranks";
  const LlamaConfig c = test_config(false);
  Built m = build(world, c, "pp=4,tsp=1");
  EXPECT_FALSE(m.decoder->decodes_in_flight(3));
  EXPECT_TRUE(m.decoder->decodes_in_flight(4));
  auto be = make_cpu_backend();
  std::vector<std::vector<int32_t>> prompts(3, std::vector<int32_t>{1, 2});
  ASSERT_TRUE(m.decoder->prefill(*be, prompts, 2).ok());
  Result<int64_t> r = m.decoder->decode_in_flight(*be, std::vector<int32_t>{1, 2, 3}, {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("3 sequences cannot keep 4 pipeline stages busy"), std::string::npos)
      << r.status().to_string();
}

// bf16 (no decoder stores bf16 weights or cache), sp stages (no decoder shards the sequence
// on the sp axis) and a dp axis (no decoder takes one), as without pp.
TEST(PipelineDecode, RefusesWhatItDoesNotRun) {
  Communicator& world = test::mpi().world();
  if (world.size() != 2 && world.size() != 4) GTEST_SKIP() << "no pp layout for " << world.size() << " ranks";
  const LlamaConfig c = test_config(false);
  const std::vector<std::string> refused =
      world.size() == 2 ? std::vector<std::string>{"pp=2,tsp=1:bf16", "pp=2,tp=1:bf16"}
                        : std::vector<std::string>{"pp=2,tsp=2:bf16", "pp=2,tp=2:bf16", "pp=2,sp=2",
                                                   "pp=2,dp=2,tsp=1", "pp=2,dp=2,tp=1"};
  for (const std::string& layout : refused) {
    const Layout lo = parse_layout(layout).value();
    Result<Mesh> mesh = Mesh::create(world, lo.mesh());
    FP_CHECK_OK(mesh.status());
    Result<std::unique_ptr<ShardedDecoder>> d = make_sharded_decoder(c, *mesh, lo);
    ASSERT_FALSE(d.ok()) << layout;
    EXPECT_EQ(d.status().code(), StatusCode::kUnimplemented) << d.status().to_string();
    EXPECT_NE(d.status().message().find(lo.to_string()), std::string::npos) << d.status().to_string();
  }
}

}  // namespace
}  // namespace foldpar
