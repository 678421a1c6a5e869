// SelfCommunicator: a communicator of one rank, for an axis a layout does not have (the sp
// axis of tp=T, the tp axis of sp=S), so that a strategy written for a mesh of both axes
// runs unchanged. Every collective is the identity of its contract at size 1 (a copy between
// the buffers when they differ, nothing when in place) and is counted like any other call
// (comm/comm_stats.h: one call, 0 bytes). Strategies skip calls on a size-1 axis anyway; this
// is what a call that reaches it does. A lone send or recv has no partner and is refused
// (unimplemented); send_recv to itself is a copy. No stream (host memory).
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace foldpar {

class SelfCommunicator final : public Communicator {
 public:
  // world_rank: this process's rank in world, for messages ("sp (world rank 3)").
  SelfCommunicator(std::string name, int world_rank);

  // color >= 0: another communicator of this one rank, named `name`; otherwise null.
  std::unique_ptr<Communicator> split(int color, int key, std::string name) override;

 protected:
  Status supports(const CommOp& op) const override;
  Status run_validated(const CommOp& op) override;
  CommRequest start_validated(const CommOp& op) override;

 private:
  int world_rank_;
};

}  // namespace foldpar
