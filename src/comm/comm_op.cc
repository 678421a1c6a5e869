// Names of operation kinds and reductions, as every message spells them.
#include "comm/comm_op.h"

namespace foldpar {

const char* comm_op_name(CommOpKind kind) {
  switch (kind) {
    case CommOpKind::kBroadcast: return "broadcast";
    case CommOpKind::kReduce: return "reduce";
    case CommOpKind::kAllReduce: return "all_reduce";
    case CommOpKind::kAllGather: return "all_gather";
    case CommOpKind::kAllGatherV: return "all_gather_v";
    case CommOpKind::kReduceScatter: return "reduce_scatter";
    case CommOpKind::kReduceScatterV: return "reduce_scatter_v";
    case CommOpKind::kAllToAll: return "all_to_all";
    case CommOpKind::kSend: return "send";
    case CommOpKind::kRecv: return "recv";
    case CommOpKind::kSendRecv: return "send_recv";
    case CommOpKind::kBarrier: return "barrier";
  }
  return "?";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

}  // namespace foldpar
