// The staging rewrite of the device communicators (comm/nccl/staging.h), on the host with a
// fake stager (no GPU needed): byte extents per operation, separate ranges, and in-place
// forms staged as one range so that they stay in place.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "comm/nccl/staging.h"

namespace foldpar::nccl_detail {
namespace {

// Stages every pointer inside `user` into host vectors and records the copies.
struct FakeStager {
  explicit FakeStager(const std::vector<float>& user) : lo(reinterpret_cast<const char*>(user.data())),
                                                         hi(lo + user.size() * sizeof(float)) {}
  Stager get() {
    return {[this](const void* p) { return static_cast<const char*>(p) >= lo && static_cast<const char*>(p) < hi; },
            [this](size_t bytes) {
              buffers.emplace_back(bytes);
              return buffers.back().data();
            },
            [this](void* dst, const void* src, size_t bytes) {
              std::memcpy(dst, src, bytes);
              ++copies;
            }};
  }
  const char* lo;
  const char* hi;
  std::vector<std::vector<char>> buffers;
  int copies = 0;
};

TEST(Staging, ByteExtentsPerOperation) {
  const size_t counts[3] = {2, 5, 7};
  CommOp op;
  op.dtype = DType::kBF16;
  op.count = 10;
  op.kind = CommOpKind::kAllGather;
  EXPECT_EQ(send_bytes(op, 1, 4), 20u);
  EXPECT_EQ(recv_bytes(op, 1, 4), 80u);
  op.kind = CommOpKind::kReduceScatter;
  EXPECT_EQ(send_bytes(op, 1, 4), 80u);
  EXPECT_EQ(recv_bytes(op, 1, 4), 20u);
  op.kind = CommOpKind::kReduce;
  EXPECT_EQ(recv_bytes(op, 1, 4), 0u);  // not the root
  EXPECT_EQ(recv_bytes(op, 0, 4), 20u);
  op.kind = CommOpKind::kAllGatherV;
  op.counts = counts;
  EXPECT_EQ(send_bytes(op, 2, 3), 14u);
  EXPECT_EQ(recv_bytes(op, 2, 3), 28u);
  op.kind = CommOpKind::kReduceScatterV;
  EXPECT_EQ(send_bytes(op, 0, 3), 28u);
  EXPECT_EQ(recv_bytes(op, 0, 3), 4u);
}

TEST(Staging, InPlaceAllGatherStaysInPlace) {
  std::vector<float> user(12, 0.0f);
  for (size_t i = 0; i < user.size(); ++i) user[i] = static_cast<float>(i);
  FakeStager fake(user);
  CommOp op;
  op.kind = CommOpKind::kAllGather;
  op.dtype = DType::kF32;
  op.count = 4;
  op.recv_buf = user.data();
  op.send_buf = user.data() + 4;  // rank 1 of 3, in place
  const StagedRange back = stage(op, 1, 3, fake.get());
  ASSERT_EQ(fake.buffers.size(), 1u);  // one range for both
  EXPECT_EQ(static_cast<const char*>(op.send_buf) - static_cast<const char*>(op.recv_buf), 16);
  EXPECT_EQ(static_cast<const float*>(op.send_buf)[0], 4.0f);  // contents copied in
  EXPECT_EQ(back.user, reinterpret_cast<char*>(user.data()));
  EXPECT_EQ(back.bytes, 48u);
}

TEST(Staging, SeparateBuffersAndUnstagedOnes) {
  std::vector<float> user(8, 1.0f), elsewhere(8, 2.0f);
  FakeStager fake(user);
  CommOp op;
  op.kind = CommOpKind::kSendRecv;
  op.dtype = DType::kF32;
  op.count = 8;
  op.send_buf = elsewhere.data();  // not staged
  op.recv_buf = user.data();       // staged
  const StagedRange back = stage(op, 0, 2, fake.get());
  EXPECT_EQ(op.send_buf, elsewhere.data());
  EXPECT_NE(op.recv_buf, user.data());
  EXPECT_EQ(back.bytes, 32u);
  EXPECT_EQ(fake.copies, 1);
}

// needs_staging answers what stage() would do, without staging: the NCCL backend groups
// only operations that need none.
TEST(Staging, NeedsStagingAgreesWithStage) {
  std::vector<float> user(8, 1.0f), elsewhere(8, 2.0f);
  const auto unreachable = [&](const void* p) {
    return static_cast<const float*>(p) >= user.data() && static_cast<const float*>(p) < user.data() + user.size();
  };
  struct Case {
    CommOpKind kind;
    const void* send;
    void* recv;
    int root;
  };
  const Case cases[] = {{CommOpKind::kSendRecv, elsewhere.data(), elsewhere.data() + 4, 0},
                        {CommOpKind::kSendRecv, elsewhere.data(), user.data(), 0},
                        {CommOpKind::kSendRecv, user.data(), elsewhere.data(), 0},
                        {CommOpKind::kReduce, elsewhere.data(), user.data(), 1},  // rank 0 is not the root: no recv
                        {CommOpKind::kReduce, elsewhere.data(), user.data(), 0},
                        {CommOpKind::kBarrier, nullptr, nullptr, 0}};
  for (const Case& c : cases) {
    CommOp op;
    op.kind = c.kind;
    op.dtype = DType::kF32;
    op.count = c.kind == CommOpKind::kBarrier ? 0 : 4;
    op.send_buf = c.send;
    op.recv_buf = c.recv;
    op.root = c.root;
    const bool predicted = needs_staging(op, 0, 2, unreachable);
    FakeStager fake(user);
    CommOp staged = op;
    (void)stage(staged, 0, 2, fake.get());
    EXPECT_EQ(predicted, fake.copies > 0) << comm_op_name(c.kind) << " root " << c.root;
  }
}

}  // namespace
}  // namespace foldpar::nccl_detail
