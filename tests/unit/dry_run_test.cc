// The dry run (plan/dry_run.h) of every layout at 2 and 4 ranks: it completes with
// storage-less tensors (any host access to tensor data kills it, so each runs in a death-
// test child and must exit 0), and its FLOPs at one rank are flop_count's. Layouts whose
// strategy still touches tensor data on the host are skipped, naming the access; the
// comparison with real runs is tests/parallel/dry_run_validation_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "model/flop_count.h"
#include "plan/dry_run.h"

namespace foldpar {
namespace {

LlamaConfig small_config() {
  LlamaConfig c;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.intermediate_size = 128;
  c.vocab_size = 96;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 4096;
  return c;
}

DryRunOptions options(const std::string& layout, int rank, DryRunMode mode) {
  DryRunOptions o;
  o.config = small_config();
  o.layout = parse_layout(layout).value();
  o.rank = rank;
  o.batch = 2;
  o.seq = 64;
  o.mode = mode;
  return o;
}

// Runs the dry run; exits 0 when it completes (a host access aborts with its message).
void run_or_exit(const DryRunOptions& o) {
  Result<DryRunResult> r = dry_run(o);
  if (!r.ok()) {
    fprintf(stderr, "dry run failed: %s\n", r.status().to_string().c_str());
    std::exit(3);
  }
  std::exit(0);
}

struct Case {
  const char* layout;
  int rank;
  DryRunMode mode;
  const char* host_access = nullptr;  // what still touches data on the host (the case skips)
  bool bf16_native = false;           // bf16 on a backend that stores it (no decorator)
};

class DryRunLayouts : public testing::TestWithParam<Case> {};

TEST_P(DryRunLayouts, CompletesWithoutHostAccess) {
  const Case c = GetParam();
  if (c.host_access != nullptr) GTEST_SKIP() << c.layout << ": host access to tensor data: " << c.host_access;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  DryRunOptions o = options(c.layout, c.rank, c.mode);
  o.matmul_takes_bf16 = o.bf16_native = c.bf16_native;
  EXPECT_EXIT(run_or_exit(o), testing::ExitedWithCode(0), "")
      << c.layout << " rank " << c.rank;
}

// TSP's backward gathers each unit's K/V again (not kept): with overlap the next unit's
// gather is posted during the current unit's backward, so GEMMs run between its start and its
// completion; without overlap it completes before any. Read off the dry run's program order.
struct GatherOverlap {
  int gathers = 0, overlapped = 0;  // the backward's non-blocking all-gathers; with a matmul in flight
};
GatherOverlap backward_kv_gathers(const std::string& layout) {
  DryRunOptions o = options(layout, 0, DryRunMode::kForwardBackward);
  Result<DryRunResult> r = dry_run(o);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  if (!r.ok()) return {};
  uint64_t backward_from = UINT64_MAX;  // the first attention backward
  for (const OpRecord& op : r->ops)
    if (op.op == "attention_backward") backward_from = std::min(backward_from, op.seq);
  EXPECT_NE(backward_from, UINT64_MAX);
  std::vector<uint64_t> matmuls;
  for (const OpRecord& op : r->ops)
    if (op.op == "matmul") matmuls.push_back(op.seq);
  GatherOverlap g;
  for (const CommEvent& start : r->comm_trace.events) {
    if (start.type != CommEvent::Type::kStart || start.kind != CommOpKind::kAllGather || start.blocking ||
        start.seq < backward_from)
      continue;
    uint64_t done = UINT64_MAX;
    for (const CommEvent& e : r->comm_trace.events)
      if (e.type == CommEvent::Type::kComplete && e.request == start.request) done = e.seq;
    EXPECT_NE(done, UINT64_MAX) << "a gather that never completes";
    ++g.gathers;
    g.overlapped += std::any_of(matmuls.begin(), matmuls.end(), [&](uint64_t m) { return m > start.seq && m < done; });
  }
  return g;
}

TEST(DryRunTspBackward, PrefetchesTheNextUnitsKvWithOverlapOnly) {
  // tsp=2, 2 layers: units (shard 0, shard 1) per layer; the gather of every layer's second
  // unit and of the last layer's first (posted before the backward's first attention) is
  // hidden: more than half.
  const GatherOverlap on = backward_kv_gathers("tsp=2"), off = backward_kv_gathers("tsp=2:nooverlap");
  EXPECT_GT(on.gathers, 0);
  EXPECT_EQ(on.gathers, off.gathers);
  EXPECT_GE(2 * on.overlapped, on.gathers) << on.overlapped << " of " << on.gathers;
  EXPECT_EQ(off.overlapped, 0);
  // Kept K/V: nothing is gathered again.
  EXPECT_EQ(backward_kv_gathers("tsp=2:keepkv").gathers, 0);
}

constexpr DryRunMode kFB = DryRunMode::kForwardBackward, kF = DryRunMode::kForward;
constexpr DryRunMode kPre = DryRunMode::kPrefill, kDec = DryRunMode::kDecode;
INSTANTIATE_TEST_SUITE_P(
    Layouts, DryRunLayouts,
    testing::Values(Case{"tsp=1", 0, kFB}, Case{"tsp=2", 1, kFB}, Case{"tsp=4", 2, kFB}, Case{"tsp=4", 2, kF},
                    Case{"tsp=2:nooverlap", 0, kFB}, Case{"tp=2", 1, kFB}, Case{"tp=4", 3, kF},
                    Case{"sp=2", 1, kFB}, Case{"sp=4:ring", 2, kFB}, Case{"tp=2,sp=2", 3, kFB},
                    Case{"tp=2,sp=2:seqpar", 1, kFB}, Case{"dp=2,tsp=2", 3, kFB}, Case{"tsp=2", 1, kPre, nullptr},
                    Case{"tsp=2", 0, kDec, nullptr}, Case{"tp=2", 1, kPre, nullptr},
                    Case{"tp=2", 0, kDec, nullptr}, Case{"tsp=2:bf16", 1, kFB}, Case{"tsp=4:bf16:recompute", 3, kFB},
                    Case{"dp=2,tsp=2:bf16", 2, kF}, Case{"tsp=2:bf16", 0, kFB, nullptr, true},
                    Case{"tsp=4:bf16", 1, kF, nullptr, true},
                    // The Megatron strategy in bf16: through the decorator and on a backend
                    // that stores bf16 itself (the CUDA backend's op rules).
                    Case{"tp=2:seqpar:bf16", 0, kFB}, Case{"tp=2:bf16", 1, kFB, nullptr, true},
                    Case{"sp=2:ring:bf16", 1, kFB, nullptr, true},
                    Case{"tp=2,sp=2:seqpar:bf16", 3, kFB, nullptr, true}),
    [](const testing::TestParamInfo<Case>& i) {
      std::string n = std::string(i.param.layout) + (i.param.bf16_native ? "_native" : "") + "_r" +
                      std::to_string(i.param.rank) +
                      (i.param.mode == kF ? "_fwd" : i.param.mode == kPre ? "_prefill" : i.param.mode == kDec ? "_decode" : "_train");
      for (char& ch : n)
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

}  // namespace
}  // namespace foldpar
