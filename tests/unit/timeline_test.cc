// The timeline (src/plan/timeline.h): hand-checkable schedules whose expected numbers are
// written out from the formulas in the header (roofline compute, ring transfers = steps x
// latency + bytes / bandwidth, link slots, waits), the critical path, the Chrome trace and
// the explanation. The hardware below uses latencies and bandwidths of different magnitudes
// per link, so swapping any two of them changes every asserted time.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "plan/timeline.h"

namespace foldpar {
namespace {

// f32 peak 1 TFLOP/s, matmul at 0.5 -> 5e11 FLOP/s; memory 100 GB/s; intra-node 10 GB/s
// with 10 us latency; inter-node 1 GB/s with 100 us latency.
Hardware test_hardware(int intra_slots = 1) {
  Hardware h;
  h.name = "timeline-test";
  h.devices_per_node = 4;
  h.memory_per_device_gb = 80;
  h.peak_tflops_f32 = 1;
  h.peak_tflops_bf16 = 4;
  h.matmul_efficiency = 0.5;
  h.memory_gb_per_s = 100;
  h.intra_node_gb_per_s = 10;
  h.inter_node_gb_per_s = 1;
  h.intra_node_latency_s = 1e-5;
  h.inter_node_latency_s = 1e-4;
  h.intra_node_concurrency = intra_slots;
  return h;
}

ComputeEvent gemm(double flops, int64_t m = 4096, int64_t n = 4096, int64_t k = 4096) {
  ComputeEvent e;
  e.op = "matmul";
  e.op_class = ComputeClass::kGemm;
  e.flops = flops;
  e.bytes = 4.0 * static_cast<double>(m * k + k * n + m * n);
  e.gemm = {m, n, k};
  return e;
}

ComputeEvent tokenwise(double bytes) {
  ComputeEvent e;
  e.op = "add_inplace";
  e.op_class = ComputeClass::kTokenwise;
  e.flops = bytes / 12;  // one add per 12 bytes: far below the memory term
  e.bytes = bytes;
  e.tokenwise = {1024, static_cast<int64_t>(bytes / 12 / 1024)};
  return e;
}

CommStart start(int64_t request, CommKind kind, const std::string& comm, int size, LinkClass link, uint64_t bytes,
                bool blocking = false) {
  CommStart s;
  s.request = request;
  s.kind = kind;
  s.communicator = comm;
  s.comm_size = size;
  s.link = link;
  s.bytes_sent = bytes;
  s.bytes_received = bytes;
  s.blocking = blocking;
  return s;
}

RankTimeline simulate(const std::vector<TimelineEvent>& events, const Hardware& hw = test_hardware()) {
  Result<RankTimeline> r = simulate_rank(RankTrace{0, events}, hw);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : RankTimeline{};
}

std::vector<std::string> path_names(const RankTimeline& r) {
  std::vector<std::string> names;
  for (const TimelineOp& op : r.critical_path) names.push_back(op.name);
  return names;
}

double path_seconds(const RankTimeline& r) {
  double s = 0;
  for (const TimelineOp& op : r.critical_path) s += op.end - op.start;
  return s;
}

const KindTotals* totals(const RankTimeline& r, const std::string& kind, const std::string& comm) {
  for (const KindTotals& k : r.by_kind)
    if (k.kind == kind && k.communicator == comm) return &k;
  return nullptr;
}

constexpr double kTol = 1e-12;

TEST(TimelinePricing, ComputeRoofline) {
  const Hardware hw = test_hardware();
  // 1e12 FLOPs at 1e12 x 0.5: 2 s (its 201 MB at 100 GB/s would be 2 ms).
  EXPECT_NEAR(compute_seconds(gemm(1e12), hw), 2.0, kTol);
  EXPECT_FALSE(memory_bound(gemm(1e12), hw));
  // bf16 uses the bf16 peak: 1e12 / (4e12 x 0.5) = 0.5 s.
  ComputeEvent b = gemm(1e12);
  b.dtype = MathDType::kBF16;
  EXPECT_NEAR(compute_seconds(b, hw), 0.5, kTol);
  // 1e10 bytes at 100 GB/s: 0.1 s, memory-bound.
  EXPECT_NEAR(compute_seconds(tokenwise(1e10), hw), 0.1, kTol);
  EXPECT_TRUE(memory_bound(tokenwise(1e10), hw));
  // A skinny GEMM (decode) whose bytes dominate: 1e9 FLOPs (2 ms) against 1e9 bytes (10 ms).
  ComputeEvent skinny = gemm(1e9, 1, 4096, 4096);
  skinny.bytes = 1e9;
  EXPECT_NEAR(compute_seconds(skinny, hw), 0.01, kTol);
}

// A token-wise op listed in tokenwise_gb_per_s_by_op streams at its own rate; the others,
// and GEMMs (whose name no table lists), at memory_gb_per_s.
TEST(TimelinePricing, TokenwiseOpAtItsOwnRate) {
  Hardware hw = test_hardware();
  hw.tokenwise_gb_per_s_by_op = {{"rmsnorm_forward", 20}, {"matmul", 1}};
  ComputeEvent norm = tokenwise(1e10);
  norm.op = "rmsnorm_forward";
  EXPECT_NEAR(compute_seconds(norm, hw), 0.5, kTol);              // 1e10 B at 20 GB/s
  EXPECT_NEAR(compute_seconds(tokenwise(1e10), hw), 0.1, kTol);  // add_inplace: not listed, 100 GB/s
  ComputeEvent skinny = gemm(1e9, 1, 4096, 4096);
  skinny.bytes = 1e9;
  EXPECT_NEAR(compute_seconds(skinny, hw), 0.01, kTol);  // a GEMM streams at memory_gb_per_s
}

TEST(TimelinePricing, GemmTableInterpolatesInLogMinDim) {
  Hardware hw = test_hardware();
  hw.gemm_efficiency_by_min_dim = {{64, 0.2}, {1024, 0.8}};
  EXPECT_NEAR(hw.gemm_efficiency(256), 0.5, kTol);  // log(256/64) / log(1024/64) = 1/2
  EXPECT_NEAR(hw.gemm_efficiency(16), 0.2, kTol);   // below the table: its first point
  EXPECT_NEAR(hw.gemm_efficiency(8192), 0.8, kTol);
  // min(M, N, K) = 256 picks the middle: 1e12 / (1e12 x 0.5) = 2 s; with M = 32, 0.2 -> 5 s.
  EXPECT_NEAR(compute_seconds(gemm(1e12, 8192, 256, 4096), hw), 2.0, 1e-9);
  EXPECT_NEAR(compute_seconds(gemm(1e12, 32, 8192, 4096), hw), 5.0, 1e-9);
  hw.gemm_efficiency_by_min_dim.clear();
  EXPECT_NEAR(hw.gemm_efficiency(256), 0.5, kTol);  // no table: matmul_efficiency
}

TEST(TimelinePricing, AttentionRatesFallBack) {
  Hardware hw = test_hardware();
  ComputeEvent fwd;
  fwd.op_class = ComputeClass::kAttentionFwd;
  fwd.flops = 1e11;
  ComputeEvent bwd = fwd;
  bwd.op_class = ComputeClass::kAttentionBwd;
  EXPECT_NEAR(compute_seconds(fwd, hw), 0.2, kTol);  // matmul_efficiency 0.5
  hw.attention_efficiency = 0.25;
  EXPECT_NEAR(compute_seconds(fwd, hw), 0.4, kTol);
  hw.attention_fwd_efficiency = 0.1;
  hw.attention_bwd_efficiency = 0.2;
  EXPECT_NEAR(compute_seconds(fwd, hw), 1.0, kTol);
  EXPECT_NEAR(compute_seconds(bwd, hw), 0.5, kTol);
}

// With a table by sequence length the call's seq_k picks the efficiency, log-linear between
// points and the nearest point outside; the single fields are then unused.
TEST(TimelinePricing, AttentionTableBySeqK) {
  Hardware hw = test_hardware();
  hw.attention_fwd_efficiency = 0.1;
  hw.attention_bwd_efficiency = 0.1;
  hw.attention_efficiency_by_seq = {{1024, 0.2, 0.1}, {4096, 0.4, 0.3}};
  ComputeEvent fwd;
  fwd.op_class = ComputeClass::kAttentionFwd;
  fwd.flops = 1e11;
  ComputeEvent bwd = fwd;
  bwd.op_class = ComputeClass::kAttentionBwd;
  fwd.attention.seq_k = bwd.attention.seq_k = 2048;  // halfway in log: 0.3 and 0.2
  EXPECT_NEAR(compute_seconds(fwd, hw), 1e11 / (1e12 * 0.3), kTol);
  EXPECT_NEAR(compute_seconds(bwd, hw), 1e11 / (1e12 * 0.2), kTol);
  fwd.attention.seq_k = 256;  // below: the first point
  EXPECT_NEAR(compute_seconds(fwd, hw), 1e11 / (1e12 * 0.2), kTol);
  bwd.attention.seq_k = 131072;  // above: the last point
  EXPECT_NEAR(compute_seconds(bwd, hw), 1e11 / (1e12 * 0.3), kTol);
}

TEST(TimelinePricing, RingTransferSeconds) {
  const Hardware hw = test_hardware();
  EXPECT_EQ(latency_steps(CommKind::kAllGather, 4), 3);
  EXPECT_EQ(latency_steps(CommKind::kReduceScatter, 4), 3);
  EXPECT_EQ(latency_steps(CommKind::kAllToAll, 4), 3);
  EXPECT_EQ(latency_steps(CommKind::kBroadcast, 4), 3);
  EXPECT_EQ(latency_steps(CommKind::kReduce, 4), 3);
  EXPECT_EQ(latency_steps(CommKind::kAllReduce, 4), 6);
  EXPECT_EQ(latency_steps(CommKind::kSendRecv, 4), 1);
  EXPECT_EQ(latency_steps(CommKind::kBarrier, 5), 3);
  EXPECT_EQ(latency_steps(CommKind::kAllReduce, 1), 0);
  // all_gather over 4 intra: 3 x 10 us + 3e8 B / 10 GB/s = 0.03003 s.
  EXPECT_NEAR(transfer_seconds(start(1, CommKind::kAllGather, "tsp", 4, LinkClass::kIntraNode, 300'000'000), hw), 0.03003,
              kTol);
  // all_reduce over 2 inter: 2 x 100 us + 1e9 B / 1 GB/s = 1.0002 s.
  EXPECT_NEAR(transfer_seconds(start(1, CommKind::kAllReduce, "dp", 2, LinkClass::kInterNode, 1'000'000'000), hw), 1.0002,
              kTol);
  // The larger direction counts: a send of 2e8 B that receives nothing, 1 x 10 us + 0.02 s.
  CommStart send = start(1, CommKind::kSend, "pp", 2, LinkClass::kIntraNode, 200'000'000);
  send.bytes_received = 0;
  EXPECT_NEAR(transfer_seconds(send, hw), 0.02001, kTol);
  EXPECT_EQ(transfer_seconds(start(1, CommKind::kAllReduce, "dp", 1, LinkClass::kInterNode, 1000), hw), 0.0);
}

TEST(TimelinePricing, CollectiveEfficiencySlowsOnlyTheBandwidthTerm) {
  Hardware hw = test_hardware();
  hw.collective_efficiency = {{"all_reduce", 0.25}};
  // 2 x 100 us + 1e9 B / (1 GB/s x 0.25) = 4.0002 s; all_gather (not listed) keeps 1.
  EXPECT_NEAR(transfer_seconds(start(1, CommKind::kAllReduce, "dp", 2, LinkClass::kInterNode, 1'000'000'000), hw), 4.0002,
              kTol);
  EXPECT_NEAR(transfer_seconds(start(1, CommKind::kAllGather, "tsp", 4, LinkClass::kIntraNode, 300'000'000), hw), 0.03003,
              kTol);
}

// A kind with a size table is priced by the table's rate at its bytes, latency as before;
// collective_efficiency and the link bandwidth no longer apply to it, other kinds keep them.
TEST(TimelinePricing, SizeTableSetsTheRateByBytes) {
  Hardware hw = test_hardware();
  hw.collective_efficiency = {{"all_reduce", 0.25}, {"all_gather", 0.5}};
  hw.intra_node_gb_per_s_by_bytes = {{"all_reduce", {{1e6, 8}, {1e8, 2}}}};
  // 1 MB at 8 GB/s: 2 x 10 us + 1e6 / 8e9 = 0.000145 s.
  EXPECT_DOUBLE_EQ(transfer_seconds(start(1, CommKind::kAllReduce, "tp", 2, LinkClass::kIntraNode, 1'000'000), hw),
                   2 * 1e-5 + 1e6 / 8e9);
  // 100 MB at 2 GB/s: 2 x 10 us + 0.05 s; a link bandwidth of 10 GB/s x 0.25 would give 0.04.
  EXPECT_DOUBLE_EQ(transfer_seconds(start(1, CommKind::kAllReduce, "tp", 2, LinkClass::kIntraNode, 100'000'000), hw),
                   2 * 1e-5 + 1e8 / 2e9);
  // 10 MB, halfway in log: 5 GB/s.
  EXPECT_NEAR(transfer_seconds(start(1, CommKind::kAllReduce, "tp", 2, LinkClass::kIntraNode, 10'000'000), hw),
              2 * 1e-5 + 1e7 / 5e9, 1e-15);
  // all_gather has no table: 10 GB/s x 0.5. The inter-node link has none for all_reduce: 1 GB/s x 0.25.
  EXPECT_DOUBLE_EQ(transfer_seconds(start(1, CommKind::kAllGather, "tsp", 2, LinkClass::kIntraNode, 100'000'000), hw),
                   1e-5 + 1e8 / 5e9);
  EXPECT_DOUBLE_EQ(transfer_seconds(start(1, CommKind::kAllReduce, "dp", 2, LinkClass::kInterNode, 100'000'000), hw),
                   2 * 1e-4 + 1e8 / 0.25e9);
  // The simulation uses it: a blocking 100 MB all_reduce stalls compute for its table price.
  const RankTimeline r = simulate({start(1, CommKind::kAllReduce, "tp", 2, LinkClass::kIntraNode, 100'000'000, true)}, hw);
  EXPECT_DOUBLE_EQ(r.step_s, 2 * 1e-5 + 1e8 / 2e9);
}

// A non-blocking start is priced by the "i" form's table where there is one; a blocking one
// never is.
TEST(TimelinePricing, NonBlockingFormHasItsOwnSizeTable) {
  Hardware hw = test_hardware();
  hw.intra_node_gb_per_s_by_bytes = {{"reduce", {{1e6, 8}}}, {"ireduce", {{1e6, 1}, {1e8, 0.1}}}};
  const CommStart posted = start(1, CommKind::kReduce, "tsp", 2, LinkClass::kIntraNode, 100'000'000);
  const CommStart blocking = start(1, CommKind::kReduce, "tsp", 2, LinkClass::kIntraNode, 100'000'000, true);
  EXPECT_DOUBLE_EQ(transfer_seconds(posted, hw), 1e-5 + 1e8 / 0.1e9);  // ireduce at 100 MB
  EXPECT_DOUBLE_EQ(transfer_seconds(blocking, hw), 1e-5 + 1e8 / 8e9);  // reduce
  CommStart small = posted;
  small.bytes_sent = small.bytes_received = 1'000'000;
  EXPECT_DOUBLE_EQ(transfer_seconds(small, hw), 1e-5 + 1e6 / 1e9);
  // The simulation: a posted 100 MB reduce waited at once stalls for the ireduce price.
  const RankTimeline r = simulate({posted, CommWait{1}}, hw);
  EXPECT_DOUBLE_EQ(r.step_s, 1e-5 + 1e8 / 0.1e9);
}

// The hardware file accepts an efficiency for every kind the timeline names.
TEST(TimelinePricing, EveryKindNameIsAHardwareKind) {
  for (int k = 0; k <= static_cast<int>(CommKind::kBarrier); ++k) {
    Hardware hw = test_hardware();
    hw.collective_efficiency = {{comm_kind_name(static_cast<CommKind>(k)), 0.5}};
    EXPECT_TRUE(hw.validate().ok()) << comm_kind_name(static_cast<CommKind>(k));
  }
}

TEST(TimelineSimulation, ComputeOnly) {
  ComputeEvent attn;
  attn.op = "attention_forward";
  attn.op_class = ComputeClass::kAttentionFwd;
  attn.flops = 1e11;  // 0.2 s
  const RankTimeline r = simulate({gemm(1e12), attn, tokenwise(1e10)});
  EXPECT_NEAR(r.step_s, 2.3, kTol);
  EXPECT_NEAR(r.compute_s, 2.3, kTol);
  EXPECT_EQ(r.exposed_comm_s, 0.0);
  EXPECT_EQ(r.comm_busy_s, 0.0);
  EXPECT_NEAR(r.memory_bound_s, 0.1, kTol);
  EXPECT_EQ(path_names(r), (std::vector<std::string>{"matmul", "attention_forward", "add_inplace"}));
  ASSERT_NE(totals(r, "gemm", ""), nullptr);
  EXPECT_NEAR(totals(r, "gemm", "")->busy_s, 2.0, kTol);
  EXPECT_EQ(totals(r, "gemm", "")->count, 1);
}

TEST(TimelineSimulation, TransferHiddenBehindCompute) {
  // all_gather 0.03003 s posted at 0, then 1 s of GEMM, then the wait: nothing exposed.
  const RankTimeline r = simulate({start(7, CommKind::kAllGather, "tsp", 4, LinkClass::kIntraNode, 300'000'000),
                                   gemm(5e11), CommWait{7}});
  EXPECT_NEAR(r.step_s, 1.0, kTol);
  EXPECT_EQ(r.exposed_comm_s, 0.0);
  EXPECT_NEAR(r.comm_busy_s, 0.03003, kTol);
  EXPECT_EQ(path_names(r), (std::vector<std::string>{"matmul"}));
  ASSERT_NE(totals(r, "all_gather", "tsp"), nullptr);
  EXPECT_EQ(totals(r, "all_gather", "tsp")->exposed_s, 0.0);
  EXPECT_NEAR(totals(r, "all_gather", "tsp")->bytes, 3e8, 0);
}

TEST(TimelineSimulation, TransferExposed) {
  // 0.2 s GEMM, post all_reduce (1.0002 s inter-node), 0.5 s GEMM, wait, 0.1 s token-wise:
  // the transfer ends at 1.2002, so compute stalls 0.5002 s and the step is 1.3002 s.
  const RankTimeline r = simulate({gemm(1e11), start(1, CommKind::kAllReduce, "dp", 2, LinkClass::kInterNode, 1'000'000'000),
                                   gemm(2.5e11), CommWait{1}, tokenwise(1e10)});
  EXPECT_NEAR(r.step_s, 1.3002, kTol);
  EXPECT_NEAR(r.compute_s, 0.8, kTol);
  EXPECT_NEAR(r.exposed_comm_s, 0.5002, kTol);
  EXPECT_NEAR(r.comm_busy_s, 1.0002, kTol);
  ASSERT_NE(totals(r, "all_reduce", "dp"), nullptr);
  EXPECT_NEAR(totals(r, "all_reduce", "dp")->exposed_s, 0.5002, kTol);
  // The critical path: the GEMM before the posting, the transfer, the token-wise op after.
  EXPECT_EQ(path_names(r), (std::vector<std::string>{"matmul", "all_reduce", "add_inplace"}));
  EXPECT_NEAR(r.critical_path[1].start, 0.2, kTol);
  EXPECT_NEAR(r.critical_path[1].end, 1.2002, kTol);
  EXPECT_NEAR(path_seconds(r), r.step_s, kTol);
  EXPECT_EQ(r.critical_path[1].stream, Stream::kCommInter);
}

// A link whose copies run on the computing cores (Hardware::*_copy_share): the wait pays
// the share of the transfer's time even when the transfer ended long before, and only the
// rest of the transfer hides behind compute. all_gather of 300 MB over 4 intra-node ranks:
// 3 x 10 us + 0.03 s = 0.03003 s; 1 s of GEMM after it.
TEST(TimelineSimulation, CopyShareTakesTheComputeStream) {
  const std::vector<TimelineEvent> events = {start(7, CommKind::kAllGather, "tsp", 4, LinkClass::kIntraNode, 300'000'000),
                                             gemm(5e11), CommWait{7}, tokenwise(1e10)};
  Hardware hw = test_hardware();
  hw.intra_node_copy_share = 1.0;
  RankTimeline r = simulate(events, hw);
  EXPECT_NEAR(r.step_s, 1.0 + 0.03003 + 0.1, kTol);  // nothing of it hidden
  EXPECT_NEAR(r.exposed_comm_s, 0.03003, kTol);
  EXPECT_NEAR(totals(r, "all_gather", "tsp")->exposed_s, 0.03003, kTol);
  // The copy bounds the stall, so the critical path runs through compute and the stall,
  // not through the transfer (which ended at 0.03003 s).
  EXPECT_EQ(path_names(r), (std::vector<std::string>{"matmul", "wait all_gather", "add_inplace"}));
  EXPECT_NEAR(path_seconds(r), r.step_s, kTol);
  hw.intra_node_copy_share = 0.5;
  r = simulate(events, hw);
  EXPECT_NEAR(r.exposed_comm_s, 0.5 * 0.03003, kTol);
  // Above 1, the copies also slow the compute beside them: the wait pays more than the
  // transfer's own time.
  hw.intra_node_copy_share = 2.5;
  r = simulate(events, hw);
  EXPECT_NEAR(r.step_s, 1.0 + 2.5 * 0.03003 + 0.1, kTol);
  EXPECT_NEAR(r.exposed_comm_s, 2.5 * 0.03003, kTol);
  // The other link class's share does not apply to an intra-node transfer.
  hw.intra_node_copy_share = 0;
  hw.inter_node_copy_share = 1;
  r = simulate(events, hw);
  EXPECT_EQ(r.exposed_comm_s, 0.0);
  // A transfer still running at the wait: the stall lasts until the later of its end and
  // the copy. 0.2 s GEMM, all_reduce inter-node (1.0002 s) posted, 0.5 s GEMM, wait: the
  // transfer ends at 1.2002 s, the copy at 0.7 + 0.5 x 1.0002 = 1.2001 s.
  hw.inter_node_copy_share = 0.5;
  r = simulate({gemm(1e11), start(1, CommKind::kAllReduce, "dp", 2, LinkClass::kInterNode, 1'000'000'000), gemm(2.5e11),
                CommWait{1}},
               hw);
  EXPECT_NEAR(r.step_s, 1.2002, kTol);
  EXPECT_EQ(path_names(r), (std::vector<std::string>{"matmul", "all_reduce"}));
  hw.inter_node_copy_share = 1;  // the copy ends at 1.7002 s, after the transfer
  r = simulate({gemm(1e11), start(1, CommKind::kAllReduce, "dp", 2, LinkClass::kInterNode, 1'000'000'000), gemm(2.5e11),
                CommWait{1}},
               hw);
  EXPECT_NEAR(r.step_s, 1.7002, kTol);
  EXPECT_EQ(path_names(r), (std::vector<std::string>{"matmul", "matmul", "wait all_reduce"}));
}

std::vector<TimelineEvent> two_transfers() {
  // Two 1e9 B send_recv over 2 intra-node ranks, 1 x 10 us + 0.1 s = 0.10001 s each, both
  // posted at 0 and waited at once.
  return {start(1, CommKind::kSendRecv, "tsp", 2, LinkClass::kIntraNode, 1'000'000'000),
          start(2, CommKind::kSendRecv, "tsp", 2, LinkClass::kIntraNode, 1'000'000'000), CommWait{1}, CommWait{2}};
}

TEST(TimelineSimulation, LinkConcurrencyOneSerializes) {
  const RankTimeline r = simulate(two_transfers(), test_hardware(1));
  EXPECT_NEAR(r.step_s, 0.20002, kTol);
  EXPECT_NEAR(r.exposed_comm_s, 0.20002, kTol);
  EXPECT_NEAR(r.comm_busy_s, 0.20002, kTol);
  // The second queued behind the first: both on the path.
  ASSERT_EQ(r.critical_path.size(), 2u);
  EXPECT_EQ(r.critical_path[0].request, 1);
  EXPECT_EQ(r.critical_path[1].request, 2);
  EXPECT_NEAR(r.critical_path[1].start, 0.10001, kTol);
}

// Full duplex: on one slot a send (out only) and a receive (in only) run side by side; two
// sends queue; a send_recv (both ways) waits for both directions.
TEST(TimelineSimulation, SendsAndReceivesUseTheirOwnDirection) {
  auto one_way = [](int64_t request, CommKind kind) {
    CommStart s = start(request, kind, "tsp", 4, LinkClass::kIntraNode, 1'000'000'000);
    (kind == CommKind::kSend ? s.bytes_received : s.bytes_sent) = 0;
    return s;
  };
  const Hardware hw = test_hardware(1);
  RankTimeline r = simulate({one_way(1, CommKind::kSend), one_way(2, CommKind::kRecv), CommWait{1}, CommWait{2}}, hw);
  EXPECT_NEAR(r.step_s, 0.10001, kTol);
  EXPECT_NEAR(r.ops.back().start, 0.0, kTol);
  r = simulate({one_way(1, CommKind::kSend), one_way(2, CommKind::kSend), CommWait{1}, CommWait{2}}, hw);
  EXPECT_NEAR(r.step_s, 0.20002, kTol);
  ASSERT_EQ(r.critical_path.size(), 2u);
  EXPECT_EQ(r.critical_path[0].request, 1);
  r = simulate({one_way(1, CommKind::kSend), one_way(2, CommKind::kRecv),
                start(3, CommKind::kSendRecv, "tsp", 4, LinkClass::kIntraNode, 1'000'000'000), CommWait{1}, CommWait{2},
                CommWait{3}},
               hw);
  EXPECT_NEAR(r.step_s, 0.20002, kTol);
  EXPECT_NEAR(r.ops.back().start, 0.10001, kTol);
}

TEST(TimelineSimulation, LinkConcurrencyTwoOverlaps) {
  const RankTimeline r = simulate(two_transfers(), test_hardware(2));
  EXPECT_NEAR(r.step_s, 0.10001, kTol);
  EXPECT_NEAR(r.comm_busy_s, 0.20002, kTol);
  ASSERT_EQ(r.critical_path.size(), 1u);
  EXPECT_EQ(r.critical_path[0].request, 1);
  // The second ran on the other slot at the same time.
  EXPECT_EQ(r.ops.back().slot, 1);
  EXPECT_NEAR(r.ops.back().start, 0.0, kTol);
  // In the Chrome trace each slot is its own thread (overlapping events on one tid would nest).
  std::vector<int> tids;
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace_json({r}));
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X" && e["cat"] == "comm") tids.push_back(e["tid"].get<int>());
  EXPECT_EQ(tids, (std::vector<int>{1, 2}));
}

TEST(TimelineSimulation, CriticalPathFollowsTheQueue) {
  // T1 (0.10001 s) posted at 0; 0.05 s of GEMM; T2 posted at 0.05 waits for the slot until
  // 0.10001 and ends at 0.20002; the wait on T2 stalls compute from 0.05. The path is T1, T2
  // (the GEMM ran beside T1), and the GEMM after the wait.
  const RankTimeline r = simulate({start(1, CommKind::kSendRecv, "tsp", 2, LinkClass::kIntraNode, 1'000'000'000), gemm(2.5e10),
                                   start(2, CommKind::kSendRecv, "tsp", 2, LinkClass::kIntraNode, 1'000'000'000), CommWait{2},
                                   CommWait{1}, gemm(5e10)});
  EXPECT_NEAR(r.step_s, 0.30002, kTol);
  EXPECT_NEAR(r.exposed_comm_s, 0.15002, kTol);
  EXPECT_EQ(path_names(r), (std::vector<std::string>{"send_recv", "send_recv", "matmul"}));
  EXPECT_EQ(r.critical_path[0].request, 1);
  EXPECT_NEAR(path_seconds(r), r.step_s, kTol);
  ASSERT_NE(totals(r, "send_recv", "tsp"), nullptr);
  EXPECT_EQ(totals(r, "send_recv", "tsp")->count, 2);
  EXPECT_NEAR(totals(r, "send_recv", "tsp")->exposed_s, 0.15002, kTol);  // all on T2's wait; T1 was done by then
}

TEST(TimelineSimulation, LinkClassesRunSideBySide) {
  // One intra (0.10001 s) and one inter (1 x 100 us + 1e8 B / 1 GB/s = 0.1001 s) transfer,
  // concurrency 1 each: separate streams, so the step is the longer of the two.
  const RankTimeline r = simulate({start(1, CommKind::kSendRecv, "tsp", 2, LinkClass::kIntraNode, 1'000'000'000),
                                   start(2, CommKind::kSendRecv, "pp", 2, LinkClass::kInterNode, 100'000'000), CommWait{1},
                                   CommWait{2}});
  EXPECT_NEAR(r.step_s, 0.1001, kTol);
}

TEST(TimelineSimulation, BlockingCollective) {
  // 1 s GEMM, then a blocking all_gather over 8 intra ranks of 7e8 B: 7 x 10 us + 0.07 s.
  const RankTimeline r = simulate({gemm(5e11), start(3, CommKind::kAllGather, "sp", 8, LinkClass::kIntraNode, 700'000'000, true)});
  EXPECT_NEAR(r.step_s, 1.07007, kTol);
  EXPECT_NEAR(r.exposed_comm_s, 0.07007, kTol);
  EXPECT_EQ(path_names(r), (std::vector<std::string>{"matmul", "all_gather"}));
  EXPECT_NEAR(path_seconds(r), r.step_s, kTol);
}

TEST(TimelineSimulation, BadTracesNameTheRequest) {
  const Hardware hw = test_hardware();
  auto error = [&](const std::vector<TimelineEvent>& events) {
    Result<RankTimeline> r = simulate_rank(RankTrace{3, events}, hw);
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : r.status().to_string();
  };
  const CommStart s = start(5, CommKind::kAllGather, "tsp", 2, LinkClass::kIntraNode, 10);
  EXPECT_NE(error({s, s}).find("request 5 is started twice"), std::string::npos);
  EXPECT_NE(error({CommWait{9}}).find("request 9, which is never started"), std::string::npos);
  EXPECT_NE(error({s, CommWait{5}, CommWait{5}}).find("already waited"), std::string::npos);
  EXPECT_NE(error({s}).find("request 5 (all_gather on tsp) is never waited"), std::string::npos);
  CommStart blocking = s;
  blocking.blocking = true;
  EXPECT_NE(error({blocking, CommWait{5}}).find("already waited"), std::string::npos);
  ComputeEvent bad = gemm(-1);
  EXPECT_NE(error({bad}).find("flops (-1)"), std::string::npos);
}

TEST(TimelineSimulation, SimulatesEachRank) {
  // Rank 1 has an extra 1 s GEMM (a pipeline's last stage, say); the error names its rank.
  const Hardware hw = test_hardware();
  Result<std::vector<RankTimeline>> r = simulate_ranks({RankTrace{0, {gemm(5e11)}}, RankTrace{1, {gemm(5e11), gemm(5e11)}}}, hw);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_NEAR((*r)[0].step_s, 1.0, kTol);
  EXPECT_NEAR((*r)[1].step_s, 2.0, kTol);
  EXPECT_EQ((*r)[1].rank, 1);
  Result<std::vector<RankTimeline>> bad = simulate_ranks({RankTrace{0, {}}, RankTrace{4, {CommWait{2}}}}, hw);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().to_string().find("rank 4 event 0"), std::string::npos) << bad.status().to_string();
}

CommStart p2p(int64_t request, CommKind kind, int peer, uint64_t bytes, bool blocking = false) {
  CommStart s = start(request, kind, "pp", 2, LinkClass::kIntraNode, bytes, blocking);
  s.peer = peer;
  return s;
}

TEST(TimelineCoupled, AReceiveWaitsForItsSend) {
  // Rank 3 computes 1 s, then sends 1e8 B (10 us + 0.01 s) to rank 7; rank 7 posts the
  // receive at 0 and waits: it stalls until the send is posted and carried, 1.01001 s.
  // Simulated alone (peers present), rank 7 would not wait at all.
  const std::vector<RankTrace> traces{
      RankTrace{3, {gemm(5e11), p2p(1, CommKind::kSend, 7, 100'000'000), CommWait{1}}},
      RankTrace{7, {p2p(1, CommKind::kRecv, 3, 100'000'000), CommWait{1}, gemm(1e11)}}};
  Result<std::vector<RankTimeline>> r = simulate_coupled(traces, test_hardware());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_NEAR((*r)[0].step_s, 1.01001, kTol);  // the sender waits for its send to be carried
  EXPECT_NEAR((*r)[1].step_s, 1.01001 + 0.2, kTol);
  EXPECT_NEAR((*r)[1].exposed_comm_s, 1.01001, kTol);
  ASSERT_NE(totals((*r)[1], "recv", "pp"), nullptr);
  EXPECT_NEAR(totals((*r)[1], "recv", "pp")->exposed_s, 1.01001, kTol);
  // Alone, the receive starts when posted: 0.01001 s exposed.
  Result<RankTimeline> alone = simulate_rank(traces[1], test_hardware());
  ASSERT_TRUE(alone.ok());
  EXPECT_NEAR(alone->exposed_comm_s, 0.01001, kTol);
}

TEST(TimelineCoupled, SendsMatchReceivesInOrderAndTheLaterPostStartsThem) {
  // Two sends 0 -> 1 posted at 0 and after 1 s; rank 1 posts both receives at 0.5 s. The
  // first pair starts at 0.5 s (the receive is the later post), the second at 1 s (the send).
  const std::vector<RankTrace> traces{
      RankTrace{0, {p2p(1, CommKind::kSend, 1, 10'000'000), gemm(5e11), p2p(2, CommKind::kSend, 1, 10'000'000),
                    CommWait{1}, CommWait{2}}},
      RankTrace{1, {gemm(2.5e11), p2p(1, CommKind::kRecv, 0, 10'000'000), p2p(2, CommKind::kRecv, 0, 10'000'000),
                    CommWait{1}, gemm(1e11), CommWait{2}}}};
  Result<std::vector<RankTimeline>> r = simulate_coupled(traces, test_hardware());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const double t = 1e-5 + 1e7 / 1e10;  // one transfer: 0.00101 s
  std::vector<const TimelineOp*> recvs;
  for (const TimelineOp& op : (*r)[1].ops)
    if (op.kind == TimelineOp::Kind::kTransfer) recvs.push_back(&op);
  ASSERT_EQ(recvs.size(), 2u);
  EXPECT_NEAR(recvs[0]->start, 0.5, kTol);
  EXPECT_NEAR(recvs[0]->end, 0.5 + t, kTol);
  EXPECT_NEAR(recvs[1]->start, 1.0, kTol);
  // Rank 1: 0.5 s, stall to 0.5 + t, 0.2 s GEMM, then the second receive (ends 1 + t) is
  // later than 0.7 + t: it stalls again.
  EXPECT_NEAR((*r)[1].step_s, 1.0 + t, kTol);
  EXPECT_NEAR((*r)[0].step_s, 1.0 + t, kTol);
}

CommStart ring_step(int64_t request, int peer, int source, uint64_t bytes) {
  CommStart s = start(request, CommKind::kSendRecv, "tsp", 3, LinkClass::kIntraNode, bytes);
  s.peer = peer;
  s.source = source;
  return s;
}

TEST(TimelineCoupled, ARingStepStartsWhenItsSourceAndPeerHavePosted) {
  // A ring of three (0 -> 1 -> 2 -> 0), one step of 1e8 B (10 us + 0.01 s): each rank
  // computes, posts the step, computes 0.2 s, waits. Rank 1 computes 1 s before posting,
  // ranks 0 and 2 0.2 s. Rank 0 sends to 1 and receives from 2: its step starts at 1 s
  // (rank 1's post), so it waits 1.01001 - 0.4. Rank 2 receives from 1: the same. Rank 1
  // waits only for the carriage. Simulated alone every rank would wait 0 (0.2 s of compute
  // hides the 0.01 s).
  const double t = 1e-5 + 0.01;
  const std::vector<RankTrace> traces{
      RankTrace{0, {gemm(1e11), ring_step(1, 1, 2, 100'000'000), gemm(1e11), CommWait{1}}},
      RankTrace{1, {gemm(5e11), ring_step(1, 2, 0, 100'000'000), gemm(1e11), CommWait{1}}},
      RankTrace{2, {gemm(1e11), ring_step(1, 0, 1, 100'000'000), gemm(1e11), CommWait{1}}}};
  Result<std::vector<RankTimeline>> r = simulate_coupled(traces, test_hardware());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_NEAR((*r)[0].step_s, 1.0 + t, kTol);
  EXPECT_NEAR((*r)[0].exposed_comm_s, 1.0 + t - 0.4, kTol);
  EXPECT_NEAR((*r)[2].step_s, 1.0 + t, kTol);
  EXPECT_NEAR((*r)[1].step_s, 1.2, kTol);  // its step ended at 1 + t, under its 0.2 s GEMM
  EXPECT_EQ((*r)[1].exposed_comm_s, 0.0);
  Result<RankTimeline> alone = simulate_rank(traces[0], test_hardware());
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(alone->exposed_comm_s, 0.0);
  // A step whose source is outside the simulated set is carried as in simulate_rank.
  Result<std::vector<RankTimeline>> two = simulate_coupled({traces[0], traces[1]}, test_hardware());
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  EXPECT_NEAR((*two)[0].step_s, 0.4, kTol);
}

CommStart collective(int64_t request, const std::vector<int>& members, uint64_t bytes) {
  CommStart s = start(request, CommKind::kAllGather, "tsp", static_cast<int>(members.size()), LinkClass::kIntraNode,
                      bytes);
  s.members = members;
  return s;
}

TEST(TimelineCoupled, ACollectiveStartsWhenItsLastMemberPosts) {
  // all_gather over ranks 0 and 1, 1e8 B (10 us + 0.01 s). Rank 1 computes 1 s first, rank
  // 0 posts at once and waits: it stalls until 1 s + the transfer. The second all_gather
  // (both post at 1.01001 s, rank 0 after 0.2 s more compute) pairs with the second.
  const double t = 1e-5 + 0.01;
  const std::vector<RankTrace> traces{
      RankTrace{0, {collective(1, {0, 1}, 100'000'000), CommWait{1}, gemm(1e11), collective(2, {0, 1}, 100'000'000),
                    CommWait{2}}},
      RankTrace{1, {gemm(5e11), collective(1, {0, 1}, 100'000'000), CommWait{1}, collective(2, {0, 1}, 100'000'000),
                    CommWait{2}}}};
  Result<std::vector<RankTimeline>> r = simulate_coupled(traces, test_hardware());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_NEAR((*r)[0].step_s, 1.0 + t + 0.2 + t, kTol);
  EXPECT_NEAR((*r)[0].exposed_comm_s, 1.0 + t + t, kTol);
  EXPECT_NEAR((*r)[1].step_s, 1.0 + t + 0.2 + t, kTol);  // its second waits for rank 0's post
  EXPECT_NEAR((*r)[1].exposed_comm_s, t + 0.2 + t, kTol);
  // Alone (or with a member outside the simulated set) the peers are present.
  Result<RankTimeline> alone = simulate_rank(traces[0], test_hardware());
  ASSERT_TRUE(alone.ok());
  EXPECT_NEAR(alone->step_s, t + 0.2 + t, kTol);
  const std::vector<RankTrace> partial{
      RankTrace{0, {collective(1, {0, 2}, 100'000'000), CommWait{1}}}, RankTrace{1, {gemm(5e11)}}};
  Result<std::vector<RankTimeline>> p = simulate_coupled(partial, test_hardware());
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_NEAR((*p)[0].step_s, t, kTol);
}

TEST(TimelineCoupled, RanksThatWaitForEverAreNamed) {
  // Both ranks wait on a receive from the other before sending: a deadlock, named.
  const std::vector<RankTrace> traces{
      RankTrace{0, {p2p(1, CommKind::kRecv, 1, 100), CommWait{1}, p2p(2, CommKind::kSend, 1, 100), CommWait{2}}},
      RankTrace{1, {p2p(1, CommKind::kRecv, 0, 100), CommWait{1}, p2p(2, CommKind::kSend, 0, 100), CommWait{2}}}};
  Result<std::vector<RankTimeline>> r = simulate_coupled(traces, test_hardware());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("wait on each other for ever: rank 0 waits on request 1 (recv on pp, peer 1)"),
            std::string::npos)
      << r.status().message();
  // A send to a rank outside the simulated set is carried as in simulate_rank.
  const std::vector<RankTrace> one{RankTrace{0, {p2p(1, CommKind::kSend, 5, 100'000'000), CommWait{1}}}};
  Result<std::vector<RankTimeline>> solo = simulate_coupled(one, test_hardware());
  ASSERT_TRUE(solo.ok()) << solo.status().to_string();
  EXPECT_NEAR((*solo)[0].step_s, 0.01001, kTol);
  // Each rank once.
  EXPECT_FALSE(simulate_coupled({one[0], one[0]}, test_hardware()).ok());
}

TEST(TimelineLinkClass, FromWorldRanks) {
  EXPECT_EQ(*link_class({0, 1, 2, 3}, 4), LinkClass::kIntraNode);
  EXPECT_EQ(*link_class({4, 5, 6, 7}, 4), LinkClass::kIntraNode);
  EXPECT_EQ(*link_class({2, 5}, 4), LinkClass::kInterNode);
  EXPECT_EQ(*link_class({0, 8, 16}, 8), LinkClass::kInterNode);  // a dp axis across nodes
  EXPECT_EQ(*link_class({0, 4}, 8), LinkClass::kIntraNode);
  EXPECT_EQ(*link_class({3}, 1), LinkClass::kIntraNode);
  EXPECT_FALSE(link_class({}, 4).ok());
  EXPECT_NE(link_class({0, 1}, 0).status().to_string().find("devices_per_node (0)"), std::string::npos);
}

TEST(TimelineChromeTrace, ParsesWithTheExpectedEvents) {
  RankTimeline r0 = simulate({gemm(1e11), start(1, CommKind::kAllReduce, "dp", 2, LinkClass::kInterNode, 1'000'000'000),
                              gemm(2.5e11), CommWait{1}});
  RankTimeline r1 = r0;
  r1.rank = 1;
  const nlohmann::json j = nlohmann::json::parse(chrome_trace_json({r0, r1}));
  ASSERT_TRUE(j.contains("traceEvents"));
  int x = 0, comm = 0, stall = 0;
  bool inter_named = false;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == "comm inter-node 0" && e["tid"] == 2)
      inter_named = true;
    if (e["ph"] != "X") continue;
    ++x;
    if (e["cat"] == "comm") {
      ++comm;
      EXPECT_EQ(e["name"], "all_reduce dp");
      EXPECT_EQ(e["tid"], 2);  // compute 0, one intra slot 1, inter slot 0 -> 2
      EXPECT_NEAR(e["ts"].get<double>(), 0.2e6, 1e-6);
      EXPECT_NEAR(e["dur"].get<double>(), 1.0002e6, 1e-6);
      EXPECT_EQ(e["args"]["bytes_sent"], 1'000'000'000u);
      EXPECT_EQ(e["args"]["communicator"], "dp");
    }
    if (e["cat"] == "stall") ++stall;
    if (e["cat"] == "compute" && e["pid"] == 0 && e["ts"] == 0) {
      EXPECT_EQ(e["args"]["flops"], 1e11);
    }
  }
  EXPECT_EQ(x, 2 * 4);  // per rank: two GEMMs, one stall, one transfer
  EXPECT_EQ(comm, 2);
  EXPECT_EQ(stall, 2);
  EXPECT_TRUE(inter_named);
}

TEST(TimelineExplain, NamesWhatBounds) {
  // 0.25 s of GEMM around an all_reduce of 1.0002 s: 0.9502 s exposed, the collective bounds.
  // 2 s of GEMM before the same all_reduce: 1.0002 s exposed, compute bounds. 0.01 s of GEMM
  // and a 0.1 s memory-bound add: memory bounds.
  const RankTimeline comm_bound = simulate({gemm(1e11), start(1, CommKind::kAllReduce, "dp", 2, LinkClass::kInterNode, 1'000'000'000),
                                            gemm(2.5e10), CommWait{1}});
  const std::string a = explain_timeline({comm_bound});
  EXPECT_NE(a.find("bound by all_reduce on dp"), std::string::npos) << a;
  EXPECT_NE(a.find("0.9502 s exposed"), std::string::npos) << a;
  EXPECT_NE(a.find("critical path: 0.2 s of compute, 1 s in 1 transfers"), std::string::npos) << a;
  const RankTimeline compute_bound = simulate({gemm(1e12), start(1, CommKind::kAllReduce, "dp", 2, LinkClass::kInterNode, 1'000'000'000),
                                               CommWait{1}});
  const std::string b = explain_timeline({compute_bound});
  EXPECT_NE(b.find("compute-bound"), std::string::npos) << b;
  const std::string c = explain_timeline({simulate({gemm(5e9), tokenwise(1e10)})});
  EXPECT_NE(c.find("bound by memory bandwidth"), std::string::npos) << c;
  // The slowest rank is explained.
  RankTimeline slow = compute_bound;
  slow.rank = 5;
  slow.step_s *= 2;
  EXPECT_NE(explain_timeline({comm_bound, slow}).find("rank 5 (the slowest of 2)"), std::string::npos);
}

}  // namespace
}  // namespace foldpar
