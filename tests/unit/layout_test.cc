// The Layout value (src/layout): its one grammar, the canonical spelling and round trip, the
// old '+' spelling read with a note, errors that name the text, and validate_layout's
// messages. The plan-against-strategy verdict table is tests/unit/layout_verdict_test.cc.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "layout/layout.h"
#include "model/flop_count.h"

namespace foldpar {
namespace {

Layout parse(const std::string& text) {
  Result<Layout> l = parse_layout(text);
  EXPECT_TRUE(l.ok()) << text << ": " << l.status().to_string();
  return l.ok() ? *l : Layout{};
}

LlamaConfig mha_config() {
  LlamaConfig c;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.intermediate_size = 256;
  c.vocab_size = 128;
  c.num_hidden_layers = 1;
  c.max_position_embeddings = 65536;
  return c;
}

TEST(LayoutGrammar, ParsesAxesAndOptions) {
  const Layout a = parse("dp=2,tp=2,sp=4:ring:seqpar");
  EXPECT_EQ(a.strategy, Strategy::kMegatron);
  EXPECT_EQ(a.dp, 2);
  EXPECT_EQ(a.tp, 2);
  EXPECT_EQ(a.sp, 4);
  EXPECT_EQ(a.ranks(), 16);
  EXPECT_EQ(a.model_ranks(), 8);
  EXPECT_EQ(a.kv_exchange, Layout::KvExchange::kRing);
  EXPECT_TRUE(a.sequence_parallel);
  EXPECT_EQ(a.mesh(), "dp=2,tp=2,sp=4");
  EXPECT_EQ(a.weight_degree(), 2);
  EXPECT_EQ(a.token_degree(), 4);
  const Layout t = parse("tsp=4:keepw:keepkv:buckets=2:bf16:recompute:contiguous:nooverlap");
  EXPECT_EQ(t.strategy, Strategy::kTsp);
  EXPECT_EQ(t.tsp, 4);
  EXPECT_TRUE(t.keep_weights);
  EXPECT_TRUE(t.keep_kv);
  EXPECT_EQ(t.head_buckets, 2);
  EXPECT_EQ(t.dtype, DType::kBF16);
  EXPECT_EQ(t.storage_bytes(), 2);
  EXPECT_EQ(t.recompute, Recompute::kBlock);
  EXPECT_EQ(t.split, SeqSplit::kContiguous);
  EXPECT_FALSE(t.overlap);
  EXPECT_EQ(t.weight_degree(), 4);
  EXPECT_EQ(t.token_degree(), 4);
  EXPECT_EQ(parse(" tp = 2 , sp = 2 ").mesh(), "tp=2,sp=2");  // spaces are ignored
}

TEST(LayoutGrammar, CanonicalSpellingRoundTrips) {
  // Axes in rank order whatever the order written; options in the grammar's order.
  EXPECT_EQ(parse("sp=2,dp=2,tp=2:seqpar:ring").to_string(), "dp=2,tp=2,sp=2:ring:seqpar");
  EXPECT_EQ(parse("tsp=2:bf16:keepw").to_string(), "tsp=2:keepw:bf16");
  // Degree-1 axes are left out; a Megatron layout keeps its tp axis when both are 1.
  EXPECT_EQ(parse("tp=1,sp=2").to_string(), "sp=2");
  EXPECT_EQ(parse("tp=2,sp=1").to_string(), "tp=2");
  EXPECT_EQ(parse("tp=1").to_string(), "tp=1");
  EXPECT_EQ(parse("dp=1,tsp=1").to_string(), "tsp=1");
  for (const char* text : {"tsp=8", "dp=4,tsp=2:buckets=2:recompute", "tp=4,sp=2:ring:seqpar:nooverlap",
                           "sp=8:contiguous:bf16", "dp=2,tp=2"}) {
    const Layout l = parse(text);
    EXPECT_EQ(l.to_string(), text);
    EXPECT_EQ(parse(l.to_string()), l) << text;
  }
  EXPECT_EQ(tsp_layout(3).to_string(), "tsp=3");
}

TEST(LayoutGrammar, OldPlusSpellingIsReadWithANote) {
  std::string note;
  Result<Layout> l = parse_layout("dp=2+tp=2+sp=4:ring", &note);
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->to_string(), "dp=2,tp=2,sp=4:ring");
  EXPECT_NE(note.find("is written 'dp=2,tp=2,sp=4:ring'"), std::string::npos) << note;
  note.clear();
  ASSERT_TRUE(parse_layout("tp=2,sp=2", &note).ok());
  EXPECT_TRUE(note.empty()) << note;
  EXPECT_FALSE(parse_layout("tp=2+sp=2,dp=2").ok());  // the two spellings mixed
}

TEST(LayoutGrammar, ListsTakeSpacesOrSemicolonsAndReadTheOldList) {
  std::string note;
  Result<std::vector<Layout>> list = parse_layout_list({"tsp=2", "tp=2,sp=2:ring;sp=4"}, &note);
  ASSERT_TRUE(list.ok()) << list.status().to_string();
  ASSERT_EQ(list->size(), 3u);
  EXPECT_EQ((*list)[1].to_string(), "tp=2,sp=2:ring");
  EXPECT_TRUE(note.empty()) << note;
  // "tp=4,sp=2" is ONE 2-D layout now (it used to be read as two).
  list = parse_layout_list({"tp=4,sp=2"}, &note);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].model_ranks(), 8);
  // The old list, with and without '+': layouts between commas, read with a note.
  list = parse_layout_list({"tsp=2,tp=2+sp=2:ring"}, &note);
  ASSERT_TRUE(list.ok()) << list.status().to_string();
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[1].to_string(), "tp=2,sp=2:ring");
  EXPECT_NE(note.find("is written 'tsp=2 tp=2,sp=2:ring'"), std::string::npos) << note;
  note.clear();
  list = parse_layout_list({"tsp=2,tp=2,sp=2:ring"}, &note);
  ASSERT_TRUE(list.ok()) << list.status().to_string();
  EXPECT_EQ(list->size(), 3u);
  EXPECT_FALSE(note.empty());
  EXPECT_FALSE(parse_layout_list({";", ""}).ok());
  EXPECT_FALSE(parse_layout_list({"tsp=2", "xp=2"}).ok());
}

TEST(LayoutGrammar, RejectsBadTextNamingIt) {
  for (const char* bad : {"", "tsp=2,tp=2", "xp=2", "tp=0", "tp=two", "tp=", "tp=2:fast", "dp=2", "tsp", "tp=2,tp=4",
                          "tsp=2:buckets=0", ":ring"}) {
    Result<Layout> l = parse_layout(bad);
    ASSERT_FALSE(l.ok()) << bad;
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(l.status().message().find(std::string("'") + bad + "'"), std::string::npos) << l.status().message();
  }
  EXPECT_NE(parse_layout("tp=2:fast").status().message().find("unknown option 'fast'"), std::string::npos);
  EXPECT_NE(parse_layout("tp=2,tp=4").status().message().find("axis 'tp' is given twice"), std::string::npos);
  EXPECT_NE(parse_layout("tp=two").status().message().find("got 'two'"), std::string::npos);
}

TEST(ValidateLayout, SizesThatDoNotDivideNameTheNumbers) {
  const LlamaConfig c = mha_config();
  auto message = [&](const std::string& layout, int64_t B, int64_t S) {
    const Status s = validate_layout(c, parse(layout), B, S);
    return s.ok() ? std::string("ok") : s.message();
  };
  EXPECT_EQ(message("tsp=3", 1, 96), "tsp=3: num_attention_heads (4) must be divisible by the TSP degree (3)");
  EXPECT_EQ(message("tp=8", 1, 96), "tp=8: num_attention_heads (4) must be divisible by the tp degree (8)");
  EXPECT_EQ(message("sp=2", 1, 102),
            "sp=2: the sequence length (102) must be divisible by 2 x the sequence degree (2 x 2 = 4) for the zigzag "
            "split");
  EXPECT_EQ(message("sp=4:contiguous", 1, 102), "sp=4:contiguous: the sequence length (102) must be divisible by the "
                                                "sequence degree (4)");
  EXPECT_EQ(message("dp=2,tsp=2", 3, 128), "dp=2,tsp=2: the batch (3) must be divisible by the data-parallel degree (2)");
  EXPECT_EQ(message("tsp=4:buckets=2", 1, 128),
            "tsp=4:buckets=2: head buckets (2) must divide the KV heads per TSP rank (1 = 4 / 4)");
  // The case the old plan got wrong: it checked S % tp, the strategy (S / sp) % tp.
  EXPECT_EQ(message("tp=4,sp=2:seqpar", 1, 20),
            "tp=4,sp=2:seqpar: the sequence length (20) must be divisible by the sp degree x the tp degree (2 x 4 = 8) "
            "with sequence parallelism (the local sequence 10 by 4)");
  EXPECT_EQ(message("tp=4:seqpar", 1, 18),
            "tp=4:seqpar: the sequence length (18) must be divisible by the tp degree (4) with sequence parallelism");
  EXPECT_EQ(message("tsp=4", 1, 128), "ok");
  EXPECT_EQ(message("tsp=4", 0, 128), "ok");  // batch not known yet
  EXPECT_EQ(message("tsp=4", 1, 0), "ok");    // a decoder: the prefill pads
}

TEST(ValidateLayout, KnobsOnLayoutsTheyDoNotApplyToAreRefused) {
  const LlamaConfig c = mha_config();
  auto message = [&](const std::string& layout) {
    const Status s = validate_layout(c, parse(layout), 1, 128);
    return s.ok() ? std::string("ok") : s.message();
  };
  EXPECT_NE(message("tp=2:keepw").find("TSP backward policies"), std::string::npos);
  EXPECT_NE(message("sp=2:buckets=2").find("TSP backward policies"), std::string::npos);
  EXPECT_NE(message("tsp=2:ring").find("is the sp axis's"), std::string::npos);
  EXPECT_NE(message("tsp=2:seqpar").find("is the tp axis's"), std::string::npos);
  // A Megatron knob on an axis of degree 1 changes nothing and is accepted.
  EXPECT_EQ(message("tp=2:ring"), "ok");
  EXPECT_EQ(message("sp=2:seqpar"), "ok");
  EXPECT_EQ(message("tp=2,sp=2:ring:seqpar"), "ok");
}

TEST(ValidateLayout, AxesNotBuiltYetAreUnimplemented) {
  const LlamaConfig c = mha_config();
  LlamaConfig two = c;
  two.num_hidden_layers = 2;
  const Status ok = validate_layout(two, parse("pp=2,tsp=2"), 1, 128);  // parallel/pipeline/
  EXPECT_TRUE(ok.ok()) << ok.message();
  EXPECT_TRUE(validate_layout(two, parse("pp=2,tp=2"), 1, 128).ok());
  EXPECT_TRUE(validate_layout(two, parse("pp=2,tp=2,sp=2"), 1, 128).ok());
  EXPECT_EQ(validate_layout(c, parse("ep=2,tsp=2"), 1, 128).code(), StatusCode::kInvalidArgument);  // no experts
  Layout bad = parse("tsp=2");
  bad.tp = 2;  // built in code, not parsed
  EXPECT_FALSE(validate_layout(c, bad, 1, 128).ok());
}

// ep=N (experts over dp replicas, docs/composition.md "Experts over dp replicas"): N = K G
// with G the model group and K dividing dp; ep is no mesh axis but part of the name.
TEST(ValidateLayout, ExpertGroupsOverDataReplicas) {
  LlamaConfig c = mha_config();
  c.moe.family = MoeFamily::kMixtral;
  c.moe.num_experts = 4;
  c.moe.num_experts_per_tok = 2;
  c.moe.moe_intermediate_size = 64;
  c.moe.norm_topk_prob = true;
  auto verdict = [&](const char* text) {
    const Status s = validate_layout(c, parse(text), 4, 128);
    return s.ok() ? std::string("ok") : s.message();
  };
  const Layout l = parse("dp=2,tp=2,ep=4");
  EXPECT_EQ(l.mesh(), "dp=2,tp=2");
  EXPECT_EQ(l.to_string(), "dp=2,tp=2,ep=4");
  EXPECT_EQ(l.expert_ranks(), 4);
  EXPECT_EQ(l.expert_replicas(), 2);
  EXPECT_EQ(parse("dp=2,tsp=2").expert_ranks(), 2);
  for (const char* ok : {"dp=2,tp=2,ep=4", "dp=2,sp=2,ep=4", "dp=2,tsp=2,ep=4", "dp=4,tsp=1,ep=4", "dp=2,tsp=1,ep=2",
                         "tp=2,ep=2", "dp=2,tsp=2,ep=4:moe=a2a", "dp=2,tsp=2,ep=4:moe=gather"})
    EXPECT_EQ(verdict(ok), "ok") << ok;
  EXPECT_EQ(verdict("dp=2,tp=2,ep=3"), "layout dp=2,tp=2,ep=3: ep (3) must be a multiple of the model group's 2 ranks "
                                       "(the expert group is ep/2 dp replicas of it)");
  EXPECT_EQ(verdict("dp=3,tp=2,ep=4"),
            "layout dp=3,tp=2,ep=4: ep/2 (2 = 4 / 2) dp replicas per expert group must divide dp (3)");
  EXPECT_EQ(verdict("dp=8,tsp=1,ep=8"), "layout dp=8,tsp=1,ep=8: the 4 experts must divide over the ep=8 ranks (whole "
                                        "experts per rank when the expert group spans dp replicas)");
  EXPECT_EQ(verdict("dp=2,tsp=2,ep=4:moe=ring"), "ok");  // the expert-weight ring over the expert group
  // Under pp each stage's expert groups are its own dp replicas: the same rules, per stage.
  c.num_hidden_layers = 2;
  // The expert-weight ring over a stage's expert group too (pipeline_moe_parity_test).
  for (const char* ok : {"pp=2,dp=2,tp=2,ep=4", "pp=2,dp=2,tsp=2,ep=4", "pp=2,dp=4,tsp=1,ep=2", "pp=2,dp=2,sp=2,ep=4",
                         "pp=2,dp=2,tsp=2,ep=4:moe=ring", "pp=2,dp=2,tsp=1,ep=2:moe=ring"})
    EXPECT_EQ(verdict(ok), "ok") << ok;
  EXPECT_EQ(verdict("pp=2,dp=2,tp=2,ep=8"),
            "layout pp=2,dp=2,tp=2,ep=8: ep/2 (4 = 8 / 2) dp replicas per expert group must divide dp (2)");
}

// The attention variants (qwen2 / attention_bias biases, qwen3 q/k norms) run on tsp, tp,
// sp and tp x sp, under pp and dp, in f32 and bf16 (tests/parallel: tsp_parity,
// megatron_parity, pipeline_parity, decode).
TEST(ValidateLayout, AttentionVariantsRunOnEveryAxis) {
  LlamaConfig qwen3 = mha_config();
  qwen3.num_hidden_layers = 2;
  qwen3.qk_norm = true;
  LlamaConfig qwen2 = qwen3;
  qwen2.qk_norm = false;
  qwen2.qkv_bias = true;
  for (const char* layout : {"tsp=1", "tsp=2", "tsp=4", "tp=2", "tp=4:seqpar", "sp=2:ring", "tp=2,sp=2", "pp=2,tsp=2",
                             "dp=2,tp=2", "pp=2,dp=2,tp=2,sp=2", "dp=4,tsp=2", "tsp=2:bf16", "tp=2:bf16",
                             "pp=2,dp=2,tsp=2:bf16"}) {
    EXPECT_TRUE(validate_layout(qwen3, parse(layout), 4, 128).ok()) << layout;
    EXPECT_TRUE(validate_layout(qwen2, parse(layout), 4, 128).ok()) << layout;
  }
}

// Llama's mlp_bias runs on every layout (replicated like the attention biases: tsp, the
// Megatron layouts, dp, pp, bf16); the parity tests hold each against the single-rank model.
TEST(ValidateLayout, MlpBiasRunsOnEveryLayout) {
  LlamaConfig c = mha_config();
  c.num_hidden_layers = 2;
  c.mlp_bias = true;
  for (const char* layout : {"tsp=1", "tp=1", "tsp=2", "tp=2:seqpar", "sp=2", "tp=2,sp=2", "dp=2,tsp=2", "pp=2,tsp=1",
                             "pp=2,tp=2:zb", "tsp=2:bf16"})
    EXPECT_TRUE(validate_layout(c, parse(layout), 4, 128).ok()) << layout << ": "
                                                                 << validate_layout(c, parse(layout), 4, 128).message();
}

TEST(LayoutStages, PipelineMeshOrderSpellingAndStageBounds) {
  // pp outermost, then dp, then the model axis (rank = (s*R + d)*D + r).
  EXPECT_EQ(parse("dp=2,tsp=2,pp=2").mesh(), "pp=2,dp=2,tsp=2");
  const Layout staged = parse("pp=4,tsp=2:stages=5/6/6/5");
  EXPECT_EQ(staged.stage_layers, (std::vector<int>{5, 6, 6, 5}));
  EXPECT_EQ(parse(staged.to_string()), staged);
  LlamaConfig c = mha_config();
  c.num_hidden_layers = 22;
  EXPECT_EQ(stage_bounds(c, staged), (std::vector<int64_t>{0, 5, 11, 17, 22}));
  // Balanced by matmul FLOPs per token: here a layer 2 (2 h q + 2 h kv + 3 h f) = 131072,
  // the head 2 h V = 16384 (1/8 layer) on the last stage, the embedding none. 22 layers:
  // stages of at most 6 (5.5 on average), the head's stage one of the 5-layer ones, the
  // earlier stages as small as the rest allows.
  EXPECT_EQ(layer_matmul_flops_per_token(c, 0), 131072);
  EXPECT_EQ(head_matmul_flops_per_token(c), 16384);
  EXPECT_EQ(stage_bounds(c, parse("pp=4,tsp=1")), (std::vector<int64_t>{0, 5, 11, 17, 22}));
  c.num_hidden_layers = 4;
  EXPECT_EQ(stage_bounds(c, parse("pp=2,tsp=1")), (std::vector<int64_t>{0, 2, 4}));
  c.num_hidden_layers = 5;  // 3 | 2 + 1/8, not 2 | 3 + 1/8
  EXPECT_EQ(stage_bounds(c, parse("pp=2,tsp=1")), (std::vector<int64_t>{0, 3, 5}));
  EXPECT_EQ(stage_bounds(c, parse("pp=4,tsp=1")), (std::vector<int64_t>{0, 1, 2, 4, 5}));
  // Every stage keeps a decoder layer, even where the end stages then carry more.
  c.num_hidden_layers = 3;
  EXPECT_EQ(stage_bounds(c, parse("pp=3,tsp=1")), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(stage_bounds(c, parse("pp=1,tsp=1")), (std::vector<int64_t>{0, 3}));
}

TEST(LayoutStages, AHeavyHeadMovesLayersOffTheLastStage) {
  LlamaConfig c = mha_config();
  c.num_hidden_layers = 8;
  EXPECT_EQ(stage_bounds(c, parse("pp=2,tsp=1")), (std::vector<int64_t>{0, 4, 8}));
  // V = 2048: the head costs two layers (2 h V = 2 x 131072), so the last stage gives one
  // up: 5 | 3 + 2, not 4 | 4 + 2.
  c.vocab_size = 2048;
  EXPECT_EQ(head_matmul_flops_per_token(c), 2 * layer_matmul_flops_per_token(c, 0));
  EXPECT_EQ(stage_bounds(c, parse("pp=2,tsp=1")), (std::vector<int64_t>{0, 5, 8}));
  // Four stages: none above 3 layers' cost (10 over 4), the most even such cut (2, 2, 3, 1 + 2),
  // not 1, 3, 3, 1 + 2 (as cheap at its most expensive, less even).
  EXPECT_EQ(stage_bounds(c, parse("pp=4,tsp=1")), (std::vector<int64_t>{0, 2, 4, 7, 8}));
  // The interleaved chunks are cut alike (p v = 4 pieces, the head with the last chunk).
  EXPECT_EQ(stage_bounds(c, parse("pp=2,tsp=1:interleaved=2")), (std::vector<int64_t>{0, 2, 4, 7, 8}));
  // --stage-layers still overrides.
  EXPECT_EQ(stage_bounds(c, parse("pp=2,tsp=1:stages=4/4")), (std::vector<int64_t>{0, 4, 8}));
  // Each stage's parameters follow the cut (local_parameter_elements): per layer q, o, k, v,
  // gate, up, down and two gains; stage 0 the embedding, stage 1 the final norm and the head.
  const int64_t h = c.hidden_size, layer = 4 * h * h + 3 * h * c.intermediate_size + 2 * h, table = c.vocab_size * h;
  EXPECT_EQ(local_parameter_elements(c, parse("pp=2,tsp=1"), 0), 5 * layer + table);
  EXPECT_EQ(local_parameter_elements(c, parse("pp=2,tsp=1"), 1), 3 * layer + h + table);
}

TEST(LayoutParameters, LocalParameterElementsShardByTheWeightDegree) {
  LlamaConfig c = mha_config();
  c.num_hidden_layers = 4;
  const int64_t norms = (2 * c.num_hidden_layers + 1) * c.hidden_size;
  const int64_t all = c.parameter_count();
  EXPECT_EQ(local_parameter_elements(c, parse("tsp=1")), all);
  EXPECT_EQ(local_parameter_elements(c, parse("sp=4")), all);
  EXPECT_EQ(local_parameter_elements(c, parse("tsp=4")), (all - norms) / 4 + norms);
  EXPECT_EQ(local_parameter_elements(c, parse("tp=2,sp=2")), (all - norms) / 2 + norms);
  // KV replicas: one KV head of wk and wv rows (2 d h) per rank and layer instead of n_kv/W of them.
  c.num_key_value_heads = 1;
  const int64_t mqa = c.parameter_count(), L = c.num_hidden_layers, h = c.hidden_size, d = c.head_dim();
  EXPECT_EQ(local_parameter_elements(c, parse("tsp=4")), (mqa - norms - L * 2 * d * h) / 4 + L * 2 * d * h + norms);
}

// Fewer KV heads than the weight degree: accepted where the degree is a multiple of them (KV
// replicas, docs/tsp.md section 3), refused with the numbers where it is not, and refused by
// name with what replicas are not built with.
TEST(ValidateLayout, FewerKvHeadsThanRanks) {
  LlamaConfig c = mha_config();
  c.num_attention_heads = 8;
  c.hidden_size = 64;
  c.num_hidden_layers = 2;  // a layer per pipeline stage
  auto message = [&](int64_t kv, const std::string& layout) {
    c.num_key_value_heads = kv;
    const Status s = validate_layout(c, parse(layout), 2, 128);
    return s.ok() ? std::string("ok") : s.message();
  };
  EXPECT_EQ(message(1, "tsp=8"), "ok");
  EXPECT_EQ(message(2, "tsp=4"), "ok");
  EXPECT_EQ(message(4, "tp=8"), "ok");
  EXPECT_EQ(message(2, "tp=4,sp=2:seqpar"), "ok");
  EXPECT_EQ(message(4, "tsp=2"), "ok");  // divisible: no replicas
  c.num_attention_heads = 24;
  c.hidden_size = 192;
  EXPECT_EQ(message(3, "tsp=8"),
            "tsp=8: num_key_value_heads (3) must be divisible by the TSP degree (8), or divide it (KV replicas)");
  EXPECT_EQ(message(6, "tp=4"),
            "tp=4: num_key_value_heads (6) must be divisible by the tp degree (4), or divide it (KV replicas)");
  c.num_attention_heads = 8;
  c.hidden_size = 64;
  EXPECT_EQ(message(1, "tsp=4:bf16"), "ok");
  EXPECT_EQ(message(1, "tsp=4:buckets=2"), "ok");  // the buckets share the rank's KV head
  EXPECT_EQ(message(1, "tsp=4:buckets=4"),
            "tsp=4:buckets=4: head buckets (4) must divide the query heads per TSP rank (2 = 8 / 4) with KV replicas");
  EXPECT_EQ(message(1, "dp=2,tp=2"), "ok");
  EXPECT_EQ(message(1, "pp=2,tsp=2"), "ok");
  EXPECT_EQ(message(2, "pp=2,dp=2,tsp=4"), "ok");
}

}  // namespace
}  // namespace foldpar
