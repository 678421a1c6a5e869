// 1F1B (pipeline_schedule.h).
#include "parallel/pipeline/pipeline_schedule.h"

#include <algorithm>

#include "core/check.h"

namespace foldpar {

std::vector<PipelineOp> one_f_one_b(int p, int s, int m) {
  FP_CHECK(p >= 1 && s >= 0 && s < p && m >= 1, "1F1B for stage {} of {} with {} micro-batches", s, p, m);
  const int warmup = std::min(p - s - 1, m);
  std::vector<PipelineOp> ops;
  int forwards = 0, backwards = 0;
  for (; forwards < warmup; ++forwards) ops.push_back({PipelineOp::Kind::kForward, forwards});
  while (forwards < m) {
    ops.push_back({PipelineOp::Kind::kForward, forwards++});
    ops.push_back({PipelineOp::Kind::kBackward, backwards++});
  }
  while (backwards < m) ops.push_back({PipelineOp::Kind::kBackward, backwards++});
  return ops;
}

int max_in_flight(const std::vector<PipelineOp>& ops) {
  int now = 0, most = 0;
  for (const PipelineOp& op : ops) {
    now += op.kind == PipelineOp::Kind::kForward ? 1 : -1;
    most = std::max(most, now);
  }
  return most;
}

}  // namespace foldpar
