// K/V all-gather and its adjoint, one collective per batch entry.
#include "parallel/kv_exchange.h"

namespace foldpar {

std::vector<CommRequest> start_gather_kv(Communicator& axis, const Tensor& local, Tensor& full) {
  const int64_t B = local.dim(0);
  FP_CHECK(full.dim(0) == B && full.numel() == local.numel() * axis.size() && full.dtype() == local.dtype(),
           "gather of {} into {} over {}", local.describe(), full.describe(), axis.describe());
  std::vector<CommRequest> requests;
  const size_t count = static_cast<size_t>(local.numel() / B);
  for (int64_t b = 0; b < B; ++b) {
    const Tensor src = local.narrow(b, b + 1);
    Tensor dst = full.narrow(b, b + 1);
    requests.push_back(axis.iall_gather(src.raw_data(), dst.raw_data(), count, local.dtype()));
  }
  return requests;
}

std::vector<CommRequest> start_reduce_scatter_kv(Communicator& axis, const Tensor& full, Tensor& local) {
  const int64_t B = local.dim(0);
  FP_CHECK(full.dim(0) == B && full.numel() == local.numel() * axis.size() && full.dtype() == local.dtype(),
           "reduce-scatter of {} into {} over {}", full.describe(), local.describe(), axis.describe());
  std::vector<CommRequest> requests;
  const size_t count = static_cast<size_t>(local.numel() / B);
  for (int64_t b = 0; b < B; ++b) {
    const Tensor src = full.narrow(b, b + 1);
    Tensor dst = local.narrow(b, b + 1);
    requests.push_back(axis.ireduce_scatter(src.raw_data(), dst.raw_data(), count, local.dtype(), ReduceOp::kSum));
  }
  return requests;
}

}  // namespace foldpar
