// K/V all-gather and its adjoint, one collective per batch entry, started as one group
// (Communicator::start_group: one NCCL launch).
#include "parallel/kv_exchange.h"

namespace foldpar {

std::vector<CommRequest> start_gather_kv(Communicator& axis, const Tensor& local, Tensor& full) {
  const int64_t B = local.dim(0);
  FP_CHECK(full.dim(0) == B && full.numel() == local.numel() * axis.size() && full.dtype() == local.dtype(),
           "gather of {} into {} over {}", local.describe(), full.describe(), axis.describe());
  const size_t count = static_cast<size_t>(local.numel() / B);
  std::vector<CommOp> ops(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    CommOp& op = ops[static_cast<size_t>(b)];
    op.kind = CommOpKind::kAllGather;
    op.send_buf = local.narrow(b, b + 1).raw_data();
    op.recv_buf = full.narrow(b, b + 1).raw_data();
    op.count = count;
    op.dtype = local.dtype();
  }
  return axis.start_group(ops);
}

std::vector<CommRequest> start_reduce_scatter_kv(Communicator& axis, const Tensor& full, Tensor& local) {
  const int64_t B = local.dim(0);
  FP_CHECK(full.dim(0) == B && full.numel() == local.numel() * axis.size() && full.dtype() == local.dtype(),
           "reduce-scatter of {} into {} over {}", full.describe(), local.describe(), axis.describe());
  const size_t count = static_cast<size_t>(local.numel() / B);
  std::vector<CommOp> ops(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    CommOp& op = ops[static_cast<size_t>(b)];
    op.kind = CommOpKind::kReduceScatter;
    op.send_buf = full.narrow(b, b + 1).raw_data();
    op.recv_buf = local.narrow(b, b + 1).raw_data();
    op.count = count;
    op.dtype = local.dtype();
    op.reduce_op = ReduceOp::kSum;
  }
  return axis.start_group(ops);
}

}  // namespace foldpar
