// The hardware file's timeline fields (src/plan/hardware.h): GEMM efficiency by shape class,
// attention forward/backward, link latency and concurrency, link rates by message size,
// calibration figures. Older files
// without them still load; every bad value is refused naming its field; the shipped
// hardware/*.json files load and state their sources.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

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
  EXPECT_TRUE(h->intra_node_gb_per_s_by_bytes.empty());  // one bandwidth for every size
  EXPECT_EQ(h->table_gb_per_s(true, "all_reduce", 1 << 20), 0.0);
  // Saved, an old file stays an old file: no empty table appears.
  EXPECT_EQ(h->to_json().find("gb_per_s_by_bytes"), std::string::npos);
}

// The rates by message size: read, interpolated in log(bytes) (the nearest point outside),
// per link class and kind, and written back unchanged.
TEST(HardwareFile, SizeTablesRoundTrip) {
  Result<Hardware> h = parse(R"("intra_node_gb_per_s_by_bytes": {"send_recv": [[1048576, 12], [268435456, 3]],
    "all_reduce": [[4194304, 8]], "ireduce": [[4096, 0.25]]}, "inter_node_gb_per_s_by_bytes": {"broadcast": [[1024, 0.5], [4096, 2]]})");
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_EQ(h->intra_node_gb_per_s_by_bytes.size(), 3u);
  EXPECT_DOUBLE_EQ(h->table_gb_per_s(true, "ireduce", 1e6), 0.25);  // the non-blocking form's key
  EXPECT_EQ(h->table_gb_per_s(true, "reduce", 1e6), 0.0);
  EXPECT_DOUBLE_EQ(h->table_gb_per_s(true, "send_recv", 1048576), 12);
  EXPECT_DOUBLE_EQ(h->table_gb_per_s(true, "send_recv", 16777216), 7.5);  // halfway in log: 2^24 of 2^20..2^28
  EXPECT_DOUBLE_EQ(h->table_gb_per_s(true, "send_recv", 1024), 12);       // below: the first point
  EXPECT_DOUBLE_EQ(h->table_gb_per_s(true, "send_recv", 1e12), 3);        // above: the last
  EXPECT_DOUBLE_EQ(h->table_gb_per_s(true, "all_reduce", 1), 8);
  EXPECT_EQ(h->table_gb_per_s(true, "broadcast", 2048), 0.0);  // the inter-node table's kind
  EXPECT_DOUBLE_EQ(h->table_gb_per_s(false, "broadcast", 2048), 1.25);
  EXPECT_EQ(h->table_gb_per_s(false, "send_recv", 2048), 0.0);
  Result<Hardware> again = Hardware::from_json(h->to_json());
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(again->to_json(), Hardware::from_json(again->to_json())->to_json());
  for (const char* kind : {"send_recv", "all_reduce", "ireduce"})
    for (double bytes : {1024.0, 1048576.0, 5e6, 16777216.0, 268435456.0})
      EXPECT_DOUBLE_EQ(again->table_gb_per_s(true, kind, bytes), h->table_gb_per_s(true, kind, bytes)) << kind << bytes;
  EXPECT_DOUBLE_EQ(again->table_gb_per_s(false, "broadcast", 2048), 1.25);
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
      {R"("measured": {"x_s": "fast"})", "measured 'x_s' must be a number"},
      {R"("intra_node_gb_per_s_by_bytes": [1])", "'intra_node_gb_per_s_by_bytes' must be an object"},
      {R"("intra_node_gb_per_s_by_bytes": {"allreduce": [[1, 1]]})", "intra_node_gb_per_s_by_bytes names an unknown kind 'allreduce'"},
      {R"("intra_node_gb_per_s_by_bytes": {"iallreduce": [[1, 1]]})", "unknown kind 'iallreduce'"},
      {R"("inter_node_gb_per_s_by_bytes": {"all_reduce": []})", "inter_node_gb_per_s_by_bytes 'all_reduce' has no points"},
      {R"("intra_node_gb_per_s_by_bytes": {"all_reduce": [[1024]]})", "'all_reduce'[0] must be [bytes, GB/s]"},
      {R"("intra_node_gb_per_s_by_bytes": {"all_reduce": [[1024, 0]]})", "'all_reduce'[0] GB/s (0) must be positive"},
      {R"("intra_node_gb_per_s_by_bytes": {"all_reduce": [[0.5, 1]]})", "'all_reduce'[0] bytes (0.5) must be at least 1"},
      {R"("intra_node_gb_per_s_by_bytes": {"all_gather": [[4096, 1], [1024, 2]]})", "'all_gather' bytes must increase (1024 after 4096)"}};
  for (const auto& [extra, needle] : bad) {
    Result<Hardware> h = parse(extra);
    ASSERT_FALSE(h.ok()) << extra;
    EXPECT_NE(h.status().message().find(needle), std::string::npos) << h.status().message();
  }
}

// The token-wise rates by op: an op listed is priced at its own rate, any other at
// memory_gb_per_s; written back unchanged; absent from an old file; bad rates refused.
TEST(HardwareFile, TokenwiseRatesByOp) {
  Result<Hardware> old = parse(R"("memory_gb_per_s": 50)");
  ASSERT_TRUE(old.ok()) << old.status().to_string();
  EXPECT_DOUBLE_EQ(old->tokenwise_gb_per_s("rmsnorm_forward"), 50);
  EXPECT_EQ(old->to_json().find("tokenwise_gb_per_s_by_op"), std::string::npos);
  Result<Hardware> h =
      parse(R"("memory_gb_per_s": 50, "tokenwise_gb_per_s_by_op": {"rmsnorm_forward": 12.5, "swiglu_backward": 8})");
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_DOUBLE_EQ(h->tokenwise_gb_per_s("rmsnorm_forward"), 12.5);
  EXPECT_DOUBLE_EQ(h->tokenwise_gb_per_s("swiglu_backward"), 8);
  EXPECT_DOUBLE_EQ(h->tokenwise_gb_per_s("add_inplace"), 50);
  Result<Hardware> again = Hardware::from_json(h->to_json());
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(again->tokenwise_gb_per_s_by_op, h->tokenwise_gb_per_s_by_op);
  for (const auto& [extra, needle] : std::vector<std::pair<std::string, std::string>>{
           {R"("tokenwise_gb_per_s_by_op": {"copy": 0})", "tokenwise_gb_per_s_by_op 'copy' (0) must be positive"},
           {R"("tokenwise_gb_per_s_by_op": {"copy": "fast"})", "tokenwise_gb_per_s_by_op 'copy' must be a number"},
           {R"("tokenwise_gb_per_s_by_op": [3])", "'tokenwise_gb_per_s_by_op' must be an object"}}) {
    Result<Hardware> bad = parse(extra);
    ASSERT_FALSE(bad.ok()) << extra;
    EXPECT_NE(bad.status().message().find(needle), std::string::npos) << bad.status().message();
  }
  h->tokenwise_gb_per_s_by_op.emplace_back("rmsnorm_forward", 13);
  const Status twice = h->validate();
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.message().find("holds 'rmsnorm_forward' twice"), std::string::npos) << twice.message();
}

// `measured` is written as a JSON object, so a name given twice would keep one figure: a
// calibration's table keys once collided with the copy-share key this way. validate() says so.
TEST(HardwareFile, RepeatedMeasuredNamesAreRefused) {
  Result<Hardware> h = parse("");
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  h->measured = {{"send_recv_16MiB_s", 0.0014}, {"copy_share_gemms_alone_s", 0.06}};
  EXPECT_TRUE(h->validate().ok());
  h->measured.emplace_back("send_recv_16MiB_s", 0.0015);
  const Status s = h->validate();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("measured holds 'send_recv_16MiB_s' twice"), std::string::npos) << s.message();
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
