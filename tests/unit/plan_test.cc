// The plan's arithmetic (src/plan): hardware descriptions and their errors, parameters per rank, the spec's forward-traffic crossover B*S = 8h read from
// the predicted (counted-convention) bytes, and the planner's choice. The predictions
// against measurement are tests/parallel/plan_validation_test.cc.
#include <gtest/gtest.h>

#include "model/flop_count.h"
#include "plan/planner.h"

namespace foldpar {
namespace {

// g = 1, f = 4h: the spec's crossover is exactly 8h.
LlamaConfig mha_config(int64_t layers = 1) {
  LlamaConfig c;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.intermediate_size = 256;
  c.vocab_size = 128;
  c.num_hidden_layers = layers;
  c.max_position_embeddings = 65536;
  return c;
}

Layout spec(const std::string& text) {
  Result<Layout> s = parse_layout(text);
  EXPECT_TRUE(s.ok()) << text << ": " << s.status().to_string();
  return s.ok() ? *s : Layout{};
}

TEST(PlanMemoryTest, TspShardsParametersGradientsAndOptimizerByD) {
  const LlamaConfig c = mha_config(4);
  const int64_t norms = (2 * c.num_hidden_layers + 1) * c.hidden_size;
  const int64_t all = c.parameter_count();
  for (int D : {2, 4}) {
    const Layout l = spec(fmt::format("tsp={}", D));
    EXPECT_EQ(local_parameter_elements(c, l), (all - norms) / D + norms) << "D=" << D;
    MemoryRequest r;
    r.seq = 256;
    Result<MemoryEstimate> one = predict_memory(c, spec("tsp=1"), r), m = predict_memory(c, l, r);
    ASSERT_TRUE(one.ok() && m.ok());
    EXPECT_EQ(m->of(MemCategory::kParameters), 4 * ((all - norms) / D + norms));
    EXPECT_EQ(m->optimizer, 8 * ((all - norms) / D + norms));
    EXPECT_LT(m->peak, one->peak);
  }
  // bf16: weights in 2 bytes, gradients f32, AdamW moments and f32 masters.
  MemoryRequest r;
  r.seq = 256;
  Result<MemoryEstimate> b = predict_memory(c, spec("tsp=2:bf16"), r);
  ASSERT_TRUE(b.ok());
  const int64_t P = local_parameter_elements(c, spec("tsp=2"));
  EXPECT_EQ(b->of(MemCategory::kParameters), 2 * P);
  EXPECT_EQ(b->optimizer, 12 * P);
}

TEST(PlanMemoryTest, RecomputeAndSequenceShardingLowerThePeak) {
  const LlamaConfig c = mha_config(4);
  MemoryRequest r;
  r.seq = 4096;
  auto peak = [&](const char* l) {
    Result<MemoryEstimate> m = predict_memory(c, spec(l), r);
    EXPECT_TRUE(m.ok()) << l;
    return m.ok() ? m->peak : 0;
  };
  EXPECT_LT(peak("tsp=2:recompute"), peak("tsp=2"));
  EXPECT_LT(peak("tp=2:seqpar"), peak("tp=2"));
  EXPECT_LT(peak("tsp=4"), peak("tsp=2"));
  EXPECT_GT(peak("tsp=2:keepkv"), peak("tsp=2"));
}

// One layer's forward traffic per rank: the 2-layer step minus the 1-layer step.
uint64_t layer_forward_bytes(const char* layout, int64_t tokens) {
  auto step = [&](int64_t L) {
    Result<StepTraffic> t = predict_traffic(mha_config(L), spec(layout), 1, tokens, PlanMode::kForward);
    EXPECT_TRUE(t.ok()) << t.status().to_string();
    return t.ok() ? t->total().bytes_received : 0;
  };
  return step(2) - step(1);
}

TEST(PlanTrafficTest, ForwardCrossoverIsEightHFromTheCountedBytes) {
  const LlamaConfig c = mha_config();
  const int64_t h = c.hidden_size;
  EXPECT_DOUBLE_EQ(tsp_tp_forward_crossover_tokens(c), 8.0 * h);
  for (int D : {2, 4}) {
    const std::string tsp = fmt::format("tsp={}", D), tp = fmt::format("tp={}", D);
    // Below 8h TP moves fewer bytes per layer, above it TSP; at 8h they are equal.
    EXPECT_GT(layer_forward_bytes(tsp.c_str(), 4 * h), layer_forward_bytes(tp.c_str(), 4 * h));
    EXPECT_EQ(layer_forward_bytes(tsp.c_str(), 8 * h), layer_forward_bytes(tp.c_str(), 8 * h));
    EXPECT_LT(layer_forward_bytes(tsp.c_str(), 16 * h), layer_forward_bytes(tp.c_str(), 16 * h));
    // And both equal the spec's formulas (elements x 4 bytes).
    EXPECT_EQ(static_cast<double>(layer_forward_bytes(tsp.c_str(), 16 * h)),
              4 * tsp_forward_layer_elements(c, 16 * h, D));
    EXPECT_EQ(static_cast<double>(layer_forward_bytes(tp.c_str(), 16 * h)), 4 * tp_forward_layer_elements(c, 16 * h, D));
  }
}

TEST(PlanTrafficTest, DecodeMovesNoWeights) {
  Result<StepTraffic> t = predict_traffic(mha_config(2), spec("tsp=4"), 4, 1024, PlanMode::kDecode);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->axes[0].op(PlanOp::kBroadcast).bytes_received, 0u);
  EXPECT_EQ(t->axes[0].op(PlanOp::kSendRecv).bytes_received, 0u);
  EXPECT_FALSE(predict_traffic(mha_config(2), spec("sp=4"), 4, 1024, PlanMode::kDecode).ok());
}

constexpr const char* kHardware = R"({"name": "test", "devices_per_node": 4, "memory_per_device_gb": 80,
  "peak_tflops_f32": 10, "peak_tflops_bf16": 100, "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10,
  "notes": "made up"})";

TEST(HardwareTest, ParsesAndRoundTrips) {
  Result<Hardware> h = Hardware::from_json(kHardware);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_EQ(h->devices_per_node, 4);
  EXPECT_EQ(h->memory_bytes(), int64_t{80} * 1000000000);
  EXPECT_DOUBLE_EQ(h->peak_flops(true), 1e14);
  EXPECT_DOUBLE_EQ(h->matmul_efficiency, 0.5);  // the default
  EXPECT_DOUBLE_EQ(h->attention_rate(), 0.5);     // unset: as matmul_efficiency
  Result<Hardware> again = Hardware::from_json(h->to_json());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->to_json(), h->to_json());
  h->attention_efficiency = 0.125;
  again = Hardware::from_json(h->to_json());
  ASSERT_TRUE(again.ok());
  EXPECT_DOUBLE_EQ(again->attention_rate(), 0.125);
}

// Compute time is the GEMMs' FLOPs at matmul_efficiency plus attention's at
// attention_efficiency, per model rank: halving attention's efficiency adds exactly its
// FLOPs' time once more.
TEST(PlannerTest, AttentionRunsAtItsOwnEfficiency) {
  const LlamaConfig c = mha_config(4);
  Hardware hw = *Hardware::from_json(kHardware);
  PlanRequest r;
  r.config = c;
  r.devices = 4;
  r.seq = 8192;
  const Layout l = spec("tsp=4");
  const StepTraffic traffic = *predict_traffic(c, l, 1, r.seq, PlanMode::kTrain);
  const MemoryEstimate memory;
  const double same = estimate_time(c, l, hw, r, traffic, memory).compute_s;
  EXPECT_NEAR(same, 3.0 * (forward_matmul_flops(c, r.seq) + forward_attention_flops(c, 1, r.seq)) / 4 /
                        (hw.peak_flops(false) * hw.matmul_efficiency),
              1e-12 * same);
  hw.attention_efficiency = hw.matmul_efficiency / 2;
  const double slower = estimate_time(c, l, hw, r, traffic, memory).compute_s;
  EXPECT_NEAR(slower - same, 3.0 * forward_attention_flops(c, 1, r.seq) / 4 / (hw.peak_flops(false) * hw.matmul_efficiency),
              1e-12 * same);
}

TEST(HardwareTest, ErrorsNameTheField) {
  const std::pair<std::string, std::string> bad[] = {
      {"[1, 2]", "JSON object"},
      {R"({"devices_per_node": 8})", "memory_per_device_gb"},
      {R"({"devices_per_node": 8, "memory_per_device_gb": -1, "peak_tflops_f32": 1, "intra_node_gb_per_s": 1,
           "inter_node_gb_per_s": 1})", "memory_per_device_gb (-1)"},
      {R"({"devices_per_node": 2.5, "memory_per_device_gb": 1, "peak_tflops_f32": 1, "intra_node_gb_per_s": 1,
           "inter_node_gb_per_s": 1})", "devices_per_node (2.5)"},
      {R"({"devices_per_node": 8, "memory_per_device_gb": 1, "peak_tflops_f32": 1, "intra_node_gb_per_s": 1,
           "inter_node_gb_per_s": 1, "bandwidth": 3})", "'bandwidth'"},
      {R"({"devices_per_node": 8, "memory_per_device_gb": "big", "peak_tflops_f32": 1, "intra_node_gb_per_s": 1,
           "inter_node_gb_per_s": 1})", "must be a number"},
      {R"({"devices_per_node": 8, "memory_per_device_gb": 1, "peak_tflops_f32": 1, "intra_node_gb_per_s": 1,
           "inter_node_gb_per_s": 1, "overlap_efficiency": 2})", "overlap_efficiency (2)"},
      {R"({"devices_per_node": 8, "memory_per_device_gb": 1, "peak_tflops_f32": 1, "intra_node_gb_per_s": 1,
           "inter_node_gb_per_s": 1, "attention_efficiency": -0.1})", "attention_efficiency (-0.1)"}};
  for (const auto& [text, needle] : bad) {
    Result<Hardware> h = Hardware::from_json(text);
    ASSERT_FALSE(h.ok()) << text;
    EXPECT_NE(h.status().message().find(needle), std::string::npos) << h.status().message();
  }
  EXPECT_EQ(Hardware::load("/nonexistent/hw.json").status().code(), StatusCode::kNotFound);
}

TEST(PlannerTest, PipelineLayoutsAreNotPlannedYetAndSaySo) {
  // One stage's dry run would hide the other stages' work and the bubble: refused by name,
  // never recommended.
  PlanRequest r;
  r.config = mha_config(4);
  r.hardware = *Hardware::from_json(kHardware);
  r.devices = 4;
  r.batch = 2;
  r.seq = 1024;
  r.layouts = {spec("tsp=4"), spec("pp=2,tsp=2")};
  Result<PlanReport> rep = make_plan(r);
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  ASSERT_EQ(rep->layouts.size(), 1u);
  EXPECT_EQ(rep->layouts[0].layout.to_string(), "tsp=4");
  ASSERT_EQ(rep->not_buildable.size(), 1u);
  EXPECT_NE(rep->not_buildable[0].find("pp=2,tsp=2: the plan does not model pipeline stages yet"), std::string::npos)
      << rep->not_buildable[0];
}

TEST(PlannerTest, RecommendsTheFastestLayoutThatFitsAndSaysByHowMuchOthersDoNot) {
  PlanRequest r;
  r.config = mha_config(4);
  r.hardware = *Hardware::from_json(kHardware);
  r.devices = 4;
  r.batch = 2;
  r.seq = 8192;
  Result<PlanReport> rep = make_plan(r);
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  ASSERT_GE(rep->recommended, 0);
  const LayoutPlan& best = rep->layouts[rep->recommended];
  for (const LayoutPlan& p : rep->layouts) {
    if (p.fits) {
      EXPECT_LE(p.time.tokens_per_s, best.time.tokens_per_s) << p.layout.to_string();
    }
  }
  // With memory smaller than sp's replicated state, sp does not fit, and says by how much.
  r.hardware.memory_per_device_gb = 1e-9 * static_cast<double>(best.memory.total());
  rep = make_plan(r);
  ASSERT_TRUE(rep.ok());
  bool some_over = false;
  for (const LayoutPlan& p : rep->layouts) {
    if (p.fits) continue;
    some_over = true;
    EXPECT_GT(p.over_bytes, 0);
    EXPECT_NE(plan_report_text(*rep).find("over by"), std::string::npos);
  }
  EXPECT_TRUE(some_over);
  EXPECT_NE(plan_report_json(*rep).find("\"recommended\""), std::string::npos);
  // dp enters where the batch divides.
  const std::vector<Layout> c4 = candidate_layouts(4, 2, PlanMode::kTrain);
  bool dp2 = false;
  for (const Layout& l : c4) dp2 = dp2 || l.to_string() == "dp=2,tsp=2";
  EXPECT_TRUE(dp2);
  r.devices = 0;
  EXPECT_FALSE(make_plan(r).ok());
}

}  // namespace
}  // namespace foldpar
