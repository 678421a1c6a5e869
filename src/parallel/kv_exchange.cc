// K/V all-gather and its adjoint, one collective per batch entry, started as one group
// (Communicator::start_group: one NCCL launch).
#include "parallel/kv_exchange.h"

namespace foldpar {
namespace {

// One `kind` collective per batch entry b, from src[b] into dst[b] (src, dst: [B, ...]), as one group.
std::vector<CommRequest> start_per_sequence(Communicator& axis, CommOpKind kind, const Tensor& src, Tensor& dst,
                                            const Tensor& local) {
  const int64_t B = local.dim(0);
  const size_t count = static_cast<size_t>(local.numel() / B);
  std::vector<CommOp> ops(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    CommOp& op = ops[static_cast<size_t>(b)];
    op.kind = kind;
    op.send_buf = src.narrow(b, b + 1).raw_data();
    op.recv_buf = dst.narrow(b, b + 1).raw_data();
    op.count = count;
    op.dtype = local.dtype();
    op.reduce_op = ReduceOp::kSum;
  }
  return axis.start_group(ops);
}

}  // namespace

std::vector<CommRequest> start_gather_kv(Communicator& axis, const Tensor& local, Tensor& full) {
  FP_CHECK(full.dim(0) == local.dim(0) && full.numel() == local.numel() * axis.size() && full.dtype() == local.dtype(),
           "gather of {} into {} over {}", local.describe(), full.describe(), axis.describe());
  return start_per_sequence(axis, CommOpKind::kAllGather, local, full, local);
}

std::vector<CommRequest> start_reduce_scatter_kv(Communicator& axis, const Tensor& full, Tensor& local) {
  FP_CHECK(full.dim(0) == local.dim(0) && full.numel() == local.numel() * axis.size() && full.dtype() == local.dtype(),
           "reduce-scatter of {} into {} over {}", full.describe(), local.describe(), axis.describe());
  return start_per_sequence(axis, CommOpKind::kReduceScatter, full, local, local);
}

}  // namespace foldpar
