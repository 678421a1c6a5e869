// SelfCommunicator: the collectives of one rank, as copies.
#include "comm/self_communicator.h"

#include <cstring>

#include "core/check.h"

namespace foldpar {

SelfCommunicator::SelfCommunicator(std::string name, int world_rank)
    : Communicator(0, 1, std::move(name), {world_rank}), world_rank_(world_rank) {}

std::unique_ptr<Communicator> SelfCommunicator::split(int color, int /*key*/, std::string name) {
  if (color < 0) return nullptr;
  return std::make_unique<SelfCommunicator>(std::move(name), world_rank_);
}

Status SelfCommunicator::supports(const CommOp& op) const {
  if (op.stream.native != nullptr) return unimplemented("a communicator of one rank runs on the host and takes no stream");
  if (op.kind == CommOpKind::kSend || op.kind == CommOpKind::kRecv)
    return unimplemented("a lone {} to itself has no partner on a communicator of one rank; use send_recv",
                         comm_op_name(op.kind));
  return Status();
}

Status SelfCommunicator::run_validated(const CommOp& op) {
  size_t count = op.count;
  switch (op.kind) {
    case CommOpKind::kBroadcast:
    case CommOpKind::kBarrier:
      return Status();  // the root's buffer is already every rank's
    case CommOpKind::kAllGatherV:
    case CommOpKind::kReduceScatterV:
      count = op.counts[0];
      break;
    case CommOpKind::kReduce:
    case CommOpKind::kAllReduce:
    case CommOpKind::kAllGather:
    case CommOpKind::kReduceScatter:
    case CommOpKind::kAllToAll:
    case CommOpKind::kSendRecv:
      break;
    case CommOpKind::kSend:
    case CommOpKind::kRecv:
      FP_CHECK(false, "{} reached a communicator of one rank", comm_op_name(op.kind));
  }
  // Every remaining kind at size 1: recv_buf [count] = send_buf [count].
  if (count > 0 && op.send_buf != op.recv_buf) std::memcpy(op.recv_buf, op.send_buf, count * dtype_size(op.dtype));
  return Status();
}

CommRequest SelfCommunicator::start_validated(const CommOp& op) {
  const Status done = run_validated(op);
  if (!done.ok()) return CommRequest::failed(done);
  return CommRequest();  // complete already
}

}  // namespace foldpar
