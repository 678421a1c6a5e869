// StageBoundary's transfers (parallel/pipeline/pipeline_boundary.h) over a recording
// communicator, in one process: each receive and send goes to the neighbouring stage with
// the purpose the watchdog reports (stage, world rank, model-axis index, micro-batch,
// direction), and the test hook runs before each send, in order.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "parallel/pipeline/pipeline_boundary.h"

namespace foldpar {
namespace {

// Completes every operation at once and keeps what reached it.
class RecordingCommunicator final : public Communicator {
 public:
  RecordingCommunicator(int rank, int size, std::vector<int> world_ranks)
      : Communicator(rank, size, "pp", std::move(world_ranks)) {}
  std::unique_ptr<Communicator> split(int, int, std::string) override { return nullptr; }
  std::vector<CommOp> ops;

 protected:
  Status supports(const CommOp&) const override { return Status::ok_status(); }
  Status run_validated(const CommOp& op) override {
    ops.push_back(op);
    return Status::ok_status();
  }
  CommRequest start_validated(const CommOp& op) override {
    ops.push_back(op);
    return CommRequest();
  }
};

TEST(StageBoundary, EveryTransferNamesWhatWouldNeverArrive) {
  RecordingCommunicator pp(1, 3, {1, 5, 9});  // stage 1 of 3: world ranks 1, 5, 9
  StepTimer timer;
  const int64_t rows = 4, h = 3;
  std::vector<std::pair<BoundaryDirection, int>> hooked;
  const BoundaryHooks hooks{[&](BoundaryDirection d, int i) { hooked.emplace_back(d, i); }};
  {
    StageBoundary boundary(pp, rows, h, DType::kF32, timer);
    boundary.set_place({"tsp", 1});
    boundary.set_hooks(&hooks);
    boundary.post_activation_recv(2);
    Tensor x = boundary.take_activation(2);
    EXPECT_EQ(x.numel(), rows * h);
    boundary.send_activation(2, std::move(x));
    Tensor dx = boundary.take_gradient(2);
    boundary.send_gradient(2, std::move(dx));
    boundary.finish();
  }
  ASSERT_EQ(pp.ops.size(), 4u);
  const struct {
    CommOpKind kind;
    int peer;
    const char* purpose;
  } want[] = {
      {CommOpKind::kRecv, 0,
       "pipeline: stage 0 (world rank 1, tsp index 1) never sent the activation of micro-batch 2 to stage 1"},
      {CommOpKind::kSend, 2,
       "pipeline: stage 2 (world rank 9, tsp index 1) never received the activation of micro-batch 2 from stage 1"},
      {CommOpKind::kRecv, 2,
       "pipeline: stage 2 (world rank 9, tsp index 1) never sent the gradient of micro-batch 2 to stage 1"},
      {CommOpKind::kSend, 0,
       "pipeline: stage 0 (world rank 1, tsp index 1) never received the gradient of micro-batch 2 from stage 1"},
  };
  for (size_t k = 0; k < 4; ++k) {
    const CommOp& op = pp.ops[k];
    EXPECT_EQ(op.kind, want[k].kind) << k;
    EXPECT_EQ(op.kind == CommOpKind::kRecv ? op.source : op.peer, want[k].peer) << k;
    EXPECT_EQ(op.count, static_cast<size_t>(rows * h)) << k;
    EXPECT_EQ(describe_purpose(op.purpose), want[k].purpose) << k;
  }
  const std::vector<std::pair<BoundaryDirection, int>> sends = {{BoundaryDirection::kActivation, 2},
                                                                {BoundaryDirection::kGradient, 2}};
  EXPECT_EQ(hooked, sends);
}

}  // namespace
}  // namespace foldpar
