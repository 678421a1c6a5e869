// The backend-independent parts of the communication layer, in one process without MPI:
// layout parsing and its messages, the checking-mode comparison, CommOptions from the
// environment, and the Communicator front end (contract checks, sequence numbers, counters,
// requests) driven through a fake backend, including communicator sizes MPI tests do not
// reach on this machine.
#include <gtest/gtest.h>

#include <cstdlib>

#include "comm/comm_options.h"
#include "comm/communicator.h"
#include "comm/mesh.h"
#include "comm/op_check.h"
#include "comm/self_communicator.h"

namespace foldpar {
namespace {

// ---- layouts ----

TEST(MeshLayout, ParsesAxesInOrderIgnoringSpaces) {
  Result<MeshLayout> layout = MeshLayout::parse(" dp = 2 , tp=3,sp =1 ");
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  ASSERT_EQ(layout->axes.size(), 3u);
  EXPECT_EQ(layout->axes[0].name, "dp");
  EXPECT_EQ(layout->axes[1].degree, 3);
  EXPECT_EQ(layout->num_ranks(), 6);
  EXPECT_EQ(layout->to_string(), "dp=2,tp=3,sp=1");
  // pp outermost, then dp, tsp fastest: rank = (s*R + d)*D + r.
  Result<MeshLayout> piped = MeshLayout::parse("pp=2,dp=2,tsp=2");
  ASSERT_TRUE(piped.ok()) << piped.status().to_string();
  EXPECT_EQ(Mesh::coords_of(*piped, (1 * 2 + 1) * 2 + 0), (std::vector<int>{1, 1, 0}));
  EXPECT_EQ(Mesh::axis_world_ranks(*piped, {0, 1, 1}, 0), (std::vector<int>{3, 7}));  // a boundary's pair
}

TEST(MeshLayout, RejectsMalformedLayoutsNamingTheProblem) {
  const std::pair<const char*, const char*> cases[] = {
      {"", "layout is empty"},
      {"tsp", "'tsp' is not name=degree"},
      {"tsp=", "the degree of axis tsp must be a positive integer, got ''"},
      {"tsp=x", "got 'x'"},
      {"tsp=0", "got '0'"},
      {"tsp=-2", "got '-2'"},
      {"tsp=4x", "got '4x'"},
      {"tsp=99999999999", "got '99999999999'"},
      {"tsp=4,", "empty axis between commas"},
      {",tsp=4", "empty axis between commas"},
      {"ep=2", "unknown axis 'ep' (known axes: pp, dp, tp, sp, tsp)"},
      {"tp=2,tp=2", "axis tp appears twice"},
      {"tp=2,dp=2", "dp must be the first (outermost) axis"},
      {"dp=2,pp=2,tsp=2", "pp must be the first (outermost) axis"},
      {"pp=2,tsp=2,dp=2", "dp must be the first (outermost) axis, or follow pp"},
  };
  for (const auto& [text, message] : cases) {
    Result<MeshLayout> layout = MeshLayout::parse(text);
    ASSERT_FALSE(layout.ok()) << "'" << text << "' parsed";
    EXPECT_EQ(layout.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(layout.status().message().find(message), std::string::npos)
        << "'" << text << "': " << layout.status().message();
  }
}

// ---- checking mode ----

CommOp collective(CommOpKind kind, size_t count, uint64_t seq) {
  CommOp op;
  op.kind = kind;
  op.count = count;
  op.seq = seq;
  return op;
}

TEST(OpCheck, DescriptorsIgnoreFieldsTheOperationDoesNotUse) {
  CommOp a = collective(CommOpKind::kAllGather, 10, 3), b = a;
  b.root = 2;
  b.reduce_op = ReduceOp::kMax;
  EXPECT_EQ(describe_collective(a), describe_collective(b));
  CommOp c = collective(CommOpKind::kBroadcast, 10, 3), d = c;
  d.root = 1;
  EXPECT_NE(describe_collective(c), describe_collective(d));
  const size_t counts1[] = {1, 2}, counts2[] = {2, 1};
  CommOp v1 = collective(CommOpKind::kAllGatherV, 0, 1), v2 = v1;
  v1.counts = counts1;
  v2.counts = counts2;
  EXPECT_NE(describe_collective(v1), describe_collective(v2)) << "same total, different counts";
}

TEST(OpCheck, NamesTheRankThatCallsSomethingElse) {
  CommOp reduce = collective(CommOpKind::kAllReduce, 100, 5), gather = collective(CommOpKind::kAllGather, 10, 5);
  const std::vector<CollectiveDescriptor> all = {describe_collective(reduce), describe_collective(gather),
                                                 describe_collective(reduce)};
  const std::vector<int> world = {0, 1, 2};
  const std::string message = find_disagreement(all, world, "world (world ranks 0-2)");
  EXPECT_EQ(message,
            "ranks disagree at collective #5 on communicator world (world ranks 0-2): rank 1 calls all_gather #5 "
            "(count 10, F32); ranks 0,2 call all_reduce #5 (count 100, F32, sum); disagreeing: rank 1");
  EXPECT_EQ(find_disagreement(std::vector<CollectiveDescriptor>(3, all[0]), world, "w"), "");
}

TEST(OpCheck, NamesWorldRanksOfASubCommunicator) {
  CommOp a = collective(CommOpKind::kBroadcast, 4, 2), b = a;
  b.root = 1;
  const std::vector<CollectiveDescriptor> all = {describe_collective(a), describe_collective(b)};
  const std::vector<int> world = {4, 6};
  const std::string message = find_disagreement(all, world, "tp (world ranks 4,6)");
  EXPECT_NE(message.find("rank 1 (world 6) calls broadcast #2 (count 4, F32, root 1)"), std::string::npos) << message;
  EXPECT_NE(message.find("disagreeing: rank 1 (world 6)"), std::string::npos) << message;
}

// ---- purposes (what the watchdog's report says an operation was for) ----

TEST(CommPurpose, FormatsItsArgumentsOnlyWhenAsked) {
  EXPECT_EQ(describe_purpose(CommPurpose{}), "");
  CommPurpose p;
  p.format = "pipeline: stage {0} (world rank {1}, {6} index {2}) never sent the gradient of micro-batch {3} to stage {4}";
  p.args = {1, 3, 1, 2, 0, 0};
  p.text = "tsp";
  EXPECT_EQ(describe_purpose(p),
            "pipeline: stage 1 (world rank 3, tsp index 1) never sent the gradient of micro-batch 2 to stage 0");
  p.format = "unused arguments are ignored: {5}";
  EXPECT_EQ(describe_purpose(p), "unused arguments are ignored: 0");
  p.format = "a bad format {9} is reported as written";
  EXPECT_EQ(describe_purpose(p), "a bad format {9} is reported as written");
}

// ---- options ----

TEST(CommOptions, ReadsTheEnvironmentAndRejectsBadValues) {
  unsetenv("FOLDPAR_COMM_CHECK");
  unsetenv("FOLDPAR_COMM_TIMEOUT");
  Result<CommOptions> defaults = CommOptions::from_env();
  ASSERT_TRUE(defaults.ok());
  EXPECT_FALSE(defaults->check);
  EXPECT_EQ(defaults->timeout_s, 300);
  EXPECT_EQ(defaults->reduce_scatter, CommOptions::ReduceScatterAlgorithm::kPairwise);
  setenv("FOLDPAR_COMM_CHECK", "1", 1);
  setenv("FOLDPAR_COMM_TIMEOUT", "2.5", 1);
  Result<CommOptions> set = CommOptions::from_env();
  ASSERT_TRUE(set.ok());
  EXPECT_TRUE(set->check);
  EXPECT_EQ(set->timeout_s, 2.5);
  setenv("FOLDPAR_COMM_TIMEOUT", "soon", 1);
  Result<CommOptions> bad = CommOptions::from_env();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("FOLDPAR_COMM_TIMEOUT='soon'"), std::string::npos);
  setenv("FOLDPAR_COMM_TIMEOUT", "1", 1);
  setenv("FOLDPAR_COMM_CHECK", "yes", 1);
  EXPECT_FALSE(CommOptions::from_env().ok());
  unsetenv("FOLDPAR_COMM_CHECK");
  unsetenv("FOLDPAR_COMM_TIMEOUT");
  setenv("FOLDPAR_REDUCE_SCATTER", "library", 1);
  Result<CommOptions> library = CommOptions::from_env();
  ASSERT_TRUE(library.ok());
  EXPECT_EQ(library->reduce_scatter, CommOptions::ReduceScatterAlgorithm::kLibrary);
  setenv("FOLDPAR_REDUCE_SCATTER", "ring", 1);
  Result<CommOptions> unknown = CommOptions::from_env();
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("FOLDPAR_REDUCE_SCATTER='ring'"), std::string::npos);
  unsetenv("FOLDPAR_REDUCE_SCATTER");
}

// ---- the Communicator front end over a fake backend ----

class FakeRequest : public CommRequestImpl {
 public:
  explicit FakeRequest(int tests_until_done) : left_(tests_until_done) {}
  Status wait() override { return Status::ok_status(); }
  Status test(bool* done) override {
    *done = --left_ <= 0;
    return Status::ok_status();
  }

 private:
  int left_;
};

// Records what reaches the backend; refuses when told to.
class FakeCommunicator : public Communicator {
 public:
  FakeCommunicator(int rank, int size, std::vector<int> world_ranks)
      : Communicator(rank, size, "fake", std::move(world_ranks)) {}
  FakeCommunicator(int rank, int size) : FakeCommunicator(rank, size, iota(size)) {}
  std::unique_ptr<Communicator> split(int, int, std::string) override { return nullptr; }

  Status refuse;
  std::vector<CommOp> ran;

 protected:
  Status supports(const CommOp&) const override { return refuse; }
  Status run_validated(const CommOp& op) override {
    ran.push_back(op);
    return Status::ok_status();
  }
  CommRequest start_validated(const CommOp& op) override {
    ran.push_back(op);
    return CommRequest(std::make_unique<FakeRequest>(2));
  }

 private:
  static std::vector<int> iota(int n) {
    std::vector<int> v(n);
    for (int i = 0; i < n; ++i) v[i] = i;
    return v;
  }
};

TEST(Communicator, DescribesItsMembersCompactly) {
  EXPECT_EQ(FakeCommunicator(0, 1, {0}).describe(), "fake (world rank 0)");
  EXPECT_EQ(FakeCommunicator(0, 2, {0, 2}).describe(), "fake (world ranks 0,2)");
  EXPECT_EQ(FakeCommunicator(0, 5, {1, 2, 3, 5, 6}).describe(), "fake (world ranks 1-3,5,6)");
}

TEST(Communicator, NumbersCollectivesAndPointToPointSeparately) {
  FakeCommunicator comm(1, 4);
  float buf[8] = {};
  ASSERT_TRUE(comm.barrier().ok());
  ASSERT_TRUE(comm.send(buf, 2, DType::kF32, 2).ok());
  ASSERT_TRUE(comm.all_reduce(buf, buf, 2, DType::kF32, ReduceOp::kSum).ok());
  CommRequest r = comm.irecv(buf, 2, DType::kF32, 0);
  ASSERT_EQ(comm.ran.size(), 4u);
  EXPECT_EQ(comm.ran[0].seq, 1u);
  EXPECT_EQ(comm.ran[1].seq, 1u);  // first point-to-point
  EXPECT_EQ(comm.ran[2].seq, 2u);
  EXPECT_EQ(comm.ran[3].seq, 2u);
  EXPECT_EQ(comm.collectives_submitted(), 2u);
  bool done = false;
  EXPECT_TRUE(r.test(&done).ok());
  EXPECT_FALSE(done);
  EXPECT_TRUE(r.pending());
  EXPECT_TRUE(r.test(&done).ok());
  EXPECT_TRUE(done);
  EXPECT_FALSE(r.pending());
}

TEST(Communicator, ARefusedOperationIsNotNumberedOrCounted) {
  FakeCommunicator comm(0, 2);
  comm.refuse = unimplemented("no");
  float buf[2] = {};
  const Status s = comm.broadcast(buf, 2, DType::kF32, 0);
  EXPECT_EQ(s.to_string(), "unimplemented: broadcast on communicator fake: no");
  CommRequest r = comm.ibroadcast(buf, 2, DType::kF32, 0);
  EXPECT_FALSE(r.pending());
  EXPECT_EQ(r.wait().code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(comm.ran.empty());
  EXPECT_EQ(comm.collectives_submitted(), 0u);
  EXPECT_EQ(comm.stats().total(), OpCounters{});
}

// The convention of comm_stats.h at sizes beyond this machine's MPI tests: per rank, and the
// totals over ranks each way equal (what a ring moves over its N links).
TEST(Communicator, CountsTheConventionAtEverySize) {
  for (int N = 1; N <= 8; ++N) {
    for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{10}, uint64_t{4099}}) {
      uint64_t bcast_recv = 0, ar_sent = 0, ar_recv = 0;
      for (int p = 0; p < N; ++p) {
        FakeCommunicator comm(p, N);
        std::vector<float> buf(N * n + 1);
        ASSERT_TRUE(comm.broadcast(buf.data(), n, DType::kF32, 2 % N).ok());
        ASSERT_TRUE(comm.all_reduce(buf.data(), buf.data(), n, DType::kF32, ReduceOp::kSum).ok());
        const OpCounters b = comm.stats().op(CommOpKind::kBroadcast), a = comm.stats().op(CommOpKind::kAllReduce);
        EXPECT_EQ(b.bytes_received, p == 2 % N ? 0 : 4 * n);
        EXPECT_EQ(b.bytes_sent, p == (2 % N + N - 1) % N ? 0 : 4 * n);
        bcast_recv += b.bytes_received;
        ar_sent += a.bytes_sent;
        ar_recv += a.bytes_received;
        if (n % N == 0) {
          EXPECT_EQ(a.bytes_sent, 4 * 2 * (N - 1) * (n / N));
        }
      }
      EXPECT_EQ(bcast_recv, 4 * (N - 1) * n) << "N=" << N << " n=" << n;
      EXPECT_EQ(ar_sent, 4 * 2 * (N - 1) * n) << "N=" << N << " n=" << n;
      EXPECT_EQ(ar_recv, ar_sent);
    }
  }
}

using CommunicatorDeathTest = ::testing::Test;

TEST_F(CommunicatorDeathTest, ContractViolationsFailAnFpCheck) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  FakeCommunicator comm(1, 3);
  float buf[64] = {};
  EXPECT_DEATH((void)comm.broadcast(buf, 4, DType::kF32, 3), "root 3 is not a rank of 3 ranks");
  EXPECT_DEATH((void)comm.send(buf, 4, DType::kF32, -1), "peer -1 is not a rank of 3 ranks");
  EXPECT_DEATH((void)comm.all_reduce(nullptr, buf, 4, DType::kF32, ReduceOp::kSum), "send_buf is null for 4");
  EXPECT_DEATH((void)comm.all_reduce(buf, buf + 1, 4, DType::kF32, ReduceOp::kSum), "overlap");
  EXPECT_DEATH((void)comm.all_gather(buf, buf, 4, DType::kF32), "overlap");  // in place is buf + rank * 4
  EXPECT_DEATH((void)comm.reduce_scatter(buf, buf, 4, DType::kF32, ReduceOp::kSum), "overlap");
  const size_t two[] = {1, 2};
  EXPECT_DEATH((void)comm.all_gather_v(buf, buf + 8, two, DType::kF32), "counts has 2 entries for 3 ranks");
  EXPECT_DEATH({ CommRequest r = comm.ibarrier(); }, "destroyed while its operation was in flight");
  // The documented in-place forms pass.
  EXPECT_TRUE(comm.all_gather(buf + 4, buf, 4, DType::kF32).ok());
  EXPECT_TRUE(comm.reduce_scatter(buf, buf + 4, 4, DType::kF32, ReduceOp::kSum).ok());
  EXPECT_TRUE(comm.all_reduce(buf, buf, 4, DType::kF32, ReduceOp::kSum).ok());
  EXPECT_TRUE(comm.reduce(buf, nullptr, 4, DType::kF32, ReduceOp::kSum, 0).ok());  // recv unused off the root
}

// A communicator of one rank: every collective is its size-1 identity (copies between
// distinct buffers, nothing in place), counted one call and 0 bytes; non-blocking forms are
// complete at once; a lone send or recv is refused, send_recv to itself copies.
TEST(SelfCommunicator, CollectivesAreTheIdentityOfOneRank) {
  SelfCommunicator comm("sp", 5);
  EXPECT_EQ(comm.size(), 1);
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.describe(), "sp (world rank 5)");
  const float in[3] = {1, 2, 3};
  float out[3] = {0, 0, 0};
  auto expect_copied = [&](const char* what) {
    for (int i = 0; i < 3; ++i) EXPECT_EQ(out[i], in[i]) << what << " [" << i << "]";
    out[0] = out[1] = out[2] = 0;
  };
  ASSERT_TRUE(comm.all_reduce(in, out, 3, DType::kF32, ReduceOp::kSum).ok());
  expect_copied("all_reduce");
  ASSERT_TRUE(comm.all_reduce(in, out, 3, DType::kF32, ReduceOp::kMax).ok());
  expect_copied("all_reduce max");
  ASSERT_TRUE(comm.reduce(in, out, 3, DType::kF32, ReduceOp::kSum, 0).ok());
  expect_copied("reduce");
  ASSERT_TRUE(comm.all_gather(in, out, 3, DType::kF32).ok());
  expect_copied("all_gather");
  ASSERT_TRUE(comm.reduce_scatter(in, out, 3, DType::kF32, ReduceOp::kSum).ok());
  expect_copied("reduce_scatter");
  const size_t counts[1] = {3};
  ASSERT_TRUE(comm.all_gather_v(in, out, counts, DType::kF32).ok());
  expect_copied("all_gather_v");
  ASSERT_TRUE(comm.reduce_scatter_v(in, out, counts, DType::kF32, ReduceOp::kSum).ok());
  expect_copied("reduce_scatter_v");
  ASSERT_TRUE(comm.all_to_all(in, out, 3, DType::kF32).ok());
  expect_copied("all_to_all");
  ASSERT_TRUE(comm.send_recv(in, out, 3, DType::kF32, 0, 0).ok());
  expect_copied("send_recv");
  CommRequest r = comm.iall_reduce(in, out, 3, DType::kF32, ReduceOp::kSum);
  EXPECT_FALSE(r.pending());
  EXPECT_TRUE(r.wait().ok());
  expect_copied("iall_reduce");
  // In place: nothing moves.
  float buf[3] = {4, 5, 6};
  ASSERT_TRUE(comm.all_reduce(buf, buf, 3, DType::kF32, ReduceOp::kSum).ok());
  ASSERT_TRUE(comm.broadcast(buf, 3, DType::kF32, 0).ok());
  ASSERT_TRUE(comm.barrier().ok());
  EXPECT_EQ(buf[0], 4);
  EXPECT_EQ(buf[2], 6);
  // Counted: one call each, no bytes (a transfer to oneself is a local copy).
  EXPECT_EQ(comm.stats().op(CommOpKind::kAllReduce).calls, 4u);
  EXPECT_EQ(comm.stats().total().bytes_sent, 0u);
  EXPECT_EQ(comm.stats().total().bytes_received, 0u);
  // A lone send or recv has no partner.
  EXPECT_EQ(comm.send(in, 3, DType::kF32, 0).code(), StatusCode::kUnimplemented);
  EXPECT_EQ(comm.recv(out, 3, DType::kF32, 0).code(), StatusCode::kUnimplemented);
  // split: another communicator of this rank, or none.
  std::unique_ptr<Communicator> half = comm.split(0, 0, "half");
  ASSERT_NE(half, nullptr);
  EXPECT_EQ(half->describe(), "half (world rank 5)");
  EXPECT_EQ(comm.split(-1, 0, "none"), nullptr);
}

}  // namespace
}  // namespace foldpar
