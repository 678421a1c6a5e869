// The hardware file's timeline fields (src/plan/hardware.h): GEMM efficiency by shape class,
// attention forward/backward, link latency and concurrency, calibration figures. Older files
// without them still load; every bad value is refused naming its field; the shipped
// hardware/*.json files load and state their sources.
#include <gtest/gtest.h>

#include <filesystem>

#include "plan/hardware.h"

namespace foldpar {
namespace {

const std::string kBase = R"("name": "t", "devices_per_node": 8, "memory_per_device_gb": 1, "peak_tflops_f32": 1,
  "intra_node_gb_per_s": 1, "inter_node_gb_per_s": 1)";

Result<Hardware> parse(const std::string& extra) {
  return Hardware::from_json("{" + kBase + (extra.empty() ? "" : ", " + extra) + "}");
}

TEST(HardwareFile, OldFilesGetTheFallbacks) {
  Result<Hardware> h = parse("");
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_TRUE(h->gemm_efficiency_by_min_dim.empty());
  EXPECT_DOUBLE_EQ(h->gemm_efficiency(512), h->matmul_efficiency);
  EXPECT_DOUBLE_EQ(h->attention_fwd_rate(), h->matmul_efficiency);
  EXPECT_DOUBLE_EQ(h->attention_bwd_rate(), h->matmul_efficiency);
  EXPECT_EQ(h->intra_node_latency_s, 0.0);
  EXPECT_EQ(h->intra_node_concurrency, 1);
  EXPECT_EQ(h->inter_node_concurrency, 1);
  EXPECT_EQ(h->intra_node_copy_share, 0.0);  // copy engines: transfers overlap compute fully
  EXPECT_EQ(h->inter_node_copy_share, 0.0);
}

TEST(HardwareFile, TimelineFieldsRoundTrip) {
  Result<Hardware> h = parse(R"("gemm_efficiency_by_min_dim": [[64, 0.25], [512, 0.75]], "attention_fwd_efficiency": 0.4,
    "attention_bwd_efficiency": 0.3, "intra_node_latency_s": 2e-6, "inter_node_latency_s": 8e-6,
    "intra_node_concurrency": 2, "inter_node_concurrency": 3, "collective_efficiency": {"all_reduce": 0.5},
    "measured": {"all_reduce_1MiB_s": 0.001}, "attention_efficiency_by_seq": [[1024, 0.5, 0.4], [4096, 0.7, 0.6]],
    "intra_node_copy_share": 0.875, "inter_node_copy_share": 0.25)");
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_EQ(h->gemm_efficiency_by_min_dim.size(), 2u);
  EXPECT_DOUBLE_EQ(h->gemm_efficiency_by_min_dim[1].first, 512);
  EXPECT_DOUBLE_EQ(h->gemm_efficiency_by_min_dim[1].second, 0.75);
  EXPECT_DOUBLE_EQ(h->attention_fwd_rate(), 0.4);
  EXPECT_DOUBLE_EQ(h->attention_bwd_rate(), 0.3);
  EXPECT_DOUBLE_EQ(h->intra_node_latency_s, 2e-6);
  EXPECT_DOUBLE_EQ(h->inter_node_latency_s, 8e-6);
  EXPECT_EQ(h->intra_node_concurrency, 2);
  EXPECT_EQ(h->inter_node_concurrency, 3);
  EXPECT_DOUBLE_EQ(h->collective_efficiency_of("all_reduce"), 0.5);
  EXPECT_DOUBLE_EQ(h->collective_efficiency_of("all_gather"), 1.0);
  ASSERT_EQ(h->measured.size(), 1u);
  EXPECT_EQ(h->measured[0].first, "all_reduce_1MiB_s");
  Result<Hardware> again = Hardware::from_json(h->to_json());
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(again->to_json(), h->to_json());
  EXPECT_EQ(again->gemm_efficiency_by_min_dim, h->gemm_efficiency_by_min_dim);
  EXPECT_EQ(again->measured, h->measured);
  EXPECT_EQ(again->inter_node_concurrency, 3);
  ASSERT_EQ(again->attention_efficiency_by_seq.size(), 2u);
  EXPECT_DOUBLE_EQ(again->attention_efficiency_by_seq[1].seq_k, 4096);
  EXPECT_DOUBLE_EQ(again->attention_efficiency_by_seq[1].backward, 0.6);
  EXPECT_DOUBLE_EQ(again->attention_fwd_rate(1024), 0.5);
  EXPECT_EQ(again->collective_efficiency, h->collective_efficiency);
  EXPECT_DOUBLE_EQ(again->intra_node_copy_share, 0.875);
  EXPECT_DOUBLE_EQ(again->inter_node_copy_share, 0.25);
}

TEST(HardwareFile, BadTimelineFieldsNameTheField) {
  const std::pair<std::string, std::string> bad[] = {
      {R"("gemm_efficiency_by_min_dim": 3)", "'gemm_efficiency_by_min_dim' must be an array"},
      {R"("gemm_efficiency_by_min_dim": [[64]])", "gemm_efficiency_by_min_dim[0] must be [min_dim, efficiency]"},
      {R"("gemm_efficiency_by_min_dim": [[64, 1.5]])", "gemm_efficiency_by_min_dim[0] efficiency (1.5)"},
      {R"("gemm_efficiency_by_min_dim": [[0, 0.5]])", "gemm_efficiency_by_min_dim[0] min_dim (0)"},
      {R"("gemm_efficiency_by_min_dim": [[512, 0.5], [64, 0.4]])", "min_dim must increase (64 after 512)"},
      {R"("attention_fwd_efficiency": 2)", "attention_fwd_efficiency (2)"},
      {R"("attention_efficiency_by_seq": [[1024, 0.5]])", "attention_efficiency_by_seq[0] must be [seq_k, forward, backward]"},
      {R"("attention_efficiency_by_seq": [[1024, 0.5, 1.5]])", "attention_efficiency_by_seq[0] efficiencies (0.5, 1.5)"},
      {R"("attention_efficiency_by_seq": [[4096, 0.5, 0.5], [1024, 0.5, 0.5]])", "seq_k must increase (1024 after 4096)"},
      {R"("attention_bwd_efficiency": -1)", "attention_bwd_efficiency (-1)"},
      {R"("intra_node_latency_s": -1e-6)", "intra_node_latency_s (-1e-06)"},
      {R"("inter_node_latency_s": 5)", "inter_node_latency_s (5)"},
      {R"("intra_node_concurrency": 0)", "intra_node_concurrency (0)"},
      {R"("intra_node_copy_share": 4.5)", "intra_node_copy_share (4.5) must lie in [0, 4]"},
      {R"("inter_node_copy_share": -0.1)", "inter_node_copy_share (-0.1) must lie in [0, 4]"},
      {R"("inter_node_concurrency": 1.5)", "inter_node_concurrency (1.5) must be an integer"},
      {R"("inter_node_concurrency": "two")", "'inter_node_concurrency' must be a number"},
      {R"("measured": [1])", "'measured' must be an object"},
      {R"("collective_efficiency": {"allreduce": 0.5})", "unknown kind 'allreduce'"},
      {R"("collective_efficiency": {"all_gather": 0})", "collective_efficiency 'all_gather' (0)"},
      {R"("collective_efficiency": {"all_gather": "slow"})", "collective_efficiency 'all_gather' must be a number"},
      {R"("measured": {"x_s": "fast"})", "measured 'x_s' must be a number"}};
  for (const auto& [extra, needle] : bad) {
    Result<Hardware> h = parse(extra);
    ASSERT_FALSE(h.ok()) << extra;
    EXPECT_NE(h.status().message().find(needle), std::string::npos) << h.status().message();
  }
}

// Every shipped description loads; the vendor ones name their sources and assumptions and
// give the links a latency.
TEST(HardwareFile, ShippedFilesLoadAndStateTheirSources) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(FOLDPAR_SOURCE_DIR) + "/hardware")) {
    if (entry.path().extension() != ".json") continue;
    ++files;
    Result<Hardware> h = Hardware::load(entry.path().string());
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    EXPECT_FALSE(h->notes.empty()) << entry.path();
    const std::string name = entry.path().filename().string();
    if (name == "h200-8.json" || name == "mi300x-8.json") {
      EXPECT_NE(h->notes.find("datasheet"), std::string::npos) << name;
      EXPECT_NE(h->notes.find("Assumptions, not measurements"), std::string::npos) << name;
      EXPECT_GT(h->intra_node_latency_s, 0) << name;
      EXPECT_GT(h->inter_node_latency_s, h->intra_node_latency_s) << name;
    }
  }
  EXPECT_GE(files, 3);
}

}  // namespace
}  // namespace foldpar
