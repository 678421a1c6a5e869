// Byte extents of each operation and the staging rewrite (comm/nccl/staging.h).
#include "comm/nccl/staging.h"

#include <algorithm>
#include <numeric>

#include "tensor/dtype.h"

namespace foldpar::nccl_detail {
namespace {

size_t sum_of(std::span<const size_t> counts) { return std::accumulate(counts.begin(), counts.end(), size_t{0}); }

}  // namespace

size_t send_bytes(const CommOp& op, int rank, int size) {
  const size_t beta = dtype_size(op.dtype), n = static_cast<size_t>(size);
  switch (op.kind) {
    case CommOpKind::kReduce:
    case CommOpKind::kAllReduce:
    case CommOpKind::kAllGather:
    case CommOpKind::kSend:
    case CommOpKind::kSendRecv: return op.count * beta;
    case CommOpKind::kAllGatherV: return op.counts[rank] * beta;
    case CommOpKind::kReduceScatter:
    case CommOpKind::kAllToAll: return n * op.count * beta;
    case CommOpKind::kReduceScatterV: return sum_of(op.counts) * beta;
    default: return 0;
  }
}

size_t recv_bytes(const CommOp& op, int rank, int size) {
  const size_t beta = dtype_size(op.dtype), n = static_cast<size_t>(size);
  switch (op.kind) {
    case CommOpKind::kBroadcast:
    case CommOpKind::kAllReduce:
    case CommOpKind::kReduceScatter:
    case CommOpKind::kRecv:
    case CommOpKind::kSendRecv: return op.count * beta;
    case CommOpKind::kReduce: return rank == op.root ? op.count * beta : 0;
    case CommOpKind::kAllGather:
    case CommOpKind::kAllToAll: return n * op.count * beta;
    case CommOpKind::kAllGatherV: return sum_of(op.counts) * beta;
    case CommOpKind::kReduceScatterV: return op.counts[rank] * beta;
    default: return 0;
  }
}

bool needs_staging(const CommOp& op, int rank, int size, const std::function<bool(const void* p)>& unreachable) {
  const bool send = op.send_buf != nullptr && send_bytes(op, rank, size) > 0 && unreachable(op.send_buf);
  return send || (op.recv_buf != nullptr && recv_bytes(op, rank, size) > 0 && unreachable(op.recv_buf));
}

StagedRange stage(CommOp& op, int rank, int size, const Stager& stager) {
  auto* send = static_cast<char*>(const_cast<void*>(op.send_buf));
  auto* recv = static_cast<char*>(op.recv_buf);
  const size_t sb = send != nullptr ? send_bytes(op, rank, size) : 0;
  const size_t rb = recv != nullptr ? recv_bytes(op, rank, size) : 0;
  const bool stage_send = sb > 0 && stager.needs_staging(send);
  const bool stage_recv = rb > 0 && stager.needs_staging(recv);
  StagedRange back;
  if (stage_send && stage_recv && send < recv + rb && recv < send + sb) {  // in-place forms: one range
    char* lo = std::min(send, recv);
    char* hi = std::max(send + sb, recv + rb);
    char* buf = stager.allocate(static_cast<size_t>(hi - lo));
    stager.copy(buf, lo, static_cast<size_t>(hi - lo));
    op.send_buf = buf + (send - lo);
    op.recv_buf = buf + (recv - lo);
    return {recv, buf + (recv - lo), rb};
  }
  if (stage_send) {
    char* buf = stager.allocate(sb);
    stager.copy(buf, send, sb);
    op.send_buf = buf;
  }
  if (stage_recv) {
    char* buf = stager.allocate(rb);
    stager.copy(buf, recv, rb);  // broadcast's root reads it; harmless elsewhere
    op.recv_buf = buf;
    back = {recv, buf, rb};
  }
  return back;
}

}  // namespace foldpar::nccl_detail
