// The plan and the strategies agree on what runs: over a grid of (config, layout, B, S), the
// plan's verdict (make_plan on that one layout) equals the verdict of building the layout's
// strategy on every one of its ranks (the strategies' create functions are not collective),
// and where both refuse, the plan names the strategy's reason. The case that drifted before
// the one validate_layout: tp=4,sp=2:seqpar at S = 20, which the plan recommended and the
// strategy refused.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "parallel/megatron/megatron_model.h"
#include "parallel/tsp/tsp_model.h"
#include "plan/planner.h"

namespace foldpar {
namespace {

LlamaConfig config_of(int64_t heads, int64_t kv_heads, int64_t f, int64_t vocab) {
  LlamaConfig c;
  c.hidden_size = 8 * heads;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.intermediate_size = f;
  c.vocab_size = vocab;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 4096;
  return c;
}

// "ok", or why the layout's strategy cannot be built on some rank.
std::string strategy_verdict(const LlamaConfig& c, const Layout& l, int64_t seq) {
  for (int p = 0; p < l.model_ranks(); ++p) {
    Status s;
    if (l.strategy == Strategy::kTsp) {
      s = TspModel::create(c, l, p, seq).status();
    } else {
      s = MegatronModel::create(c, l, p % l.tp, p / l.tp, seq).status();
    }
    if (!s.ok()) return s.message();
  }
  return "ok";
}

// "ok", or the plan's reason for not building the layout.
std::string plan_verdict(const LlamaConfig& c, const Layout& l, int64_t batch, int64_t seq, const Hardware& hw) {
  PlanRequest r;
  r.config = c;
  r.hardware = hw;
  r.devices = l.ranks();
  r.batch = batch;
  r.seq = seq;
  r.layouts = {l};
  Result<PlanReport> report = make_plan(r);
  if (!report.ok()) return report.status().message();
  return report->layouts.size() == 1 ? "ok" : "no row";
}

TEST(LayoutVerdict, ThePlanRefusesExactlyWhatTheStrategiesRefuse) {
  Result<Hardware> hw = Hardware::load(std::string(FOLDPAR_SOURCE_DIR) + "/hardware/this-machine.json");
  ASSERT_TRUE(hw.ok()) << hw.status().to_string();
  const LlamaConfig configs[] = {config_of(8, 4, 192, 256), config_of(8, 8, 96, 250), config_of(4, 2, 64, 128)};
  const char* layouts[] = {"tsp=1",         "tsp=2",          "tsp=3",          "tsp=4",
                           "tsp=8",         "tsp=2:buckets=2", "tsp=4:buckets=2", "tsp=2:contiguous",
                           "dp=2,tsp=2",    "tp=1",           "tp=2",           "tp=4",
                           "tp=8",          "tp=2:seqpar",    "tp=4:seqpar",    "sp=2",
                           "sp=4",          "sp=2:ring",      "sp=4:contiguous", "tp=2,sp=2",
                           "tp=4,sp=2:seqpar", "tp=2,sp=2:seqpar:ring", "tp=2,sp=4:contiguous", "dp=2,tp=2"};
  int agreed_ok = 0, agreed_refused = 0;
  for (const LlamaConfig& c : configs) {
    for (const char* text : layouts) {
      const Layout l = parse_layout(text).value();
      for (int64_t seq : {20, 24, 32, 48, 66}) {
        const std::string strategy = strategy_verdict(c, l, seq);
        const std::string plan = plan_verdict(c, l, 2, seq, *hw);
        const std::string where = std::string(text) + " S=" + std::to_string(seq) +
                                  " heads=" + std::to_string(c.num_attention_heads) + "/" +
                                  std::to_string(c.num_key_value_heads) + " V=" + std::to_string(c.vocab_size);
        if (strategy == "ok") {
          EXPECT_EQ(plan, "ok") << where;
          ++agreed_ok;
        } else {
          EXPECT_NE(plan.find(strategy), std::string::npos) << where << ": plan '" << plan << "', strategy '"
                                                           << strategy << "'";
          ++agreed_refused;
        }
      }
    }
  }
  // The grid must exercise both verdicts, or it proves nothing.
  std::printf("[verdicts] %d agreed runnable, %d agreed refused\n", agreed_ok, agreed_refused);
  EXPECT_GT(agreed_ok, 50);
  EXPECT_GT(agreed_refused, 50);
}

TEST(LayoutVerdict, TheCaseThatDriftedIsRefusedByBoth) {
  Result<Hardware> hw = Hardware::load(std::string(FOLDPAR_SOURCE_DIR) + "/hardware/this-machine.json");
  ASSERT_TRUE(hw.ok());
  const LlamaConfig c = config_of(8, 4, 192, 256);  // configs/tiny.json's shape
  const Layout l = parse_layout("tp=4,sp=2:seqpar").value();
  const std::string strategy = strategy_verdict(c, l, 20);
  EXPECT_NE(strategy.find("the sequence length (20) must be divisible by the sp degree x the tp degree (2 x 4 = 8)"),
            std::string::npos)
      << strategy;
  EXPECT_NE(plan_verdict(c, l, 2, 20, *hw).find(strategy), std::string::npos);
}

}  // namespace
}  // namespace foldpar
