// Names of operation kinds and reductions, as every message spells them.
#include "comm/comm_op.h"

#include <fmt/format.h>

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

std::string describe_purpose(const CommPurpose& purpose) {
  if (purpose.format == nullptr) return "";
  const auto& a = purpose.args;
  try {
    return fmt::format(fmt::runtime(purpose.format), a[0], a[1], a[2], a[3], a[4], a[5],
                       purpose.text != nullptr ? purpose.text : "");
  } catch (const fmt::format_error&) {
    return purpose.format;
  }
}

}  // namespace foldpar
