// 1F1B, interleaved 1F1B and ZB-H1 (pipeline_schedule.h).
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

int interleaved_warmup(int p, int s, int m, int v) {
  const int total = m * v;
  if (m < p) return total;  // one group: every forward first
  return std::min((p - s - 1) * 2 + (v - 1) * p, total);
}

std::vector<PipelineOp> interleaved_one_f_one_b(int p, int s, int m, int v) {
  const int g = std::min(p, m);  // micro-batches per group
  FP_CHECK(p >= 1 && s >= 0 && s < p && m >= 1 && v >= 1 && m % g == 0,
           "interleaved 1F1B for rank {} of {} with {} micro-batches and {} chunks", s, p, m, v);
  const int total = m * v, warmup = interleaved_warmup(p, s, m, v);
  // The k-th forward or backward of the rank: which micro-batch, which local chunk.
  auto op = [&](PipelineOp::Kind kind, int k) {
    const int chunk = (k % (g * v)) / g;
    return PipelineOp{kind, (k / (g * v)) * g + k % g, kind == PipelineOp::Kind::kForward ? chunk : v - 1 - chunk};
  };
  std::vector<PipelineOp> ops;
  int forwards = 0, backwards = 0;
  for (; forwards < warmup; ++forwards) ops.push_back(op(PipelineOp::Kind::kForward, forwards));
  while (forwards < total) {
    ops.push_back(op(PipelineOp::Kind::kForward, forwards++));
    ops.push_back(op(PipelineOp::Kind::kBackward, backwards++));
  }
  while (backwards < total) ops.push_back(op(PipelineOp::Kind::kBackward, backwards++));
  return ops;
}

std::vector<PipelineOp> zero_bubble_h1(int p, int s, int m) {
  FP_CHECK(p >= 1 && s >= 0 && s < p && m >= 1, "ZB-H1 for stage {} of {} with {} micro-batches", s, p, m);
  std::vector<PipelineOp> ops;
  ops.reserve(static_cast<size_t>(3 * m));
  for (int x = 0; x < m + p - 1; ++x) {
    const int b = x - (p - 1 - s), w = x - (p - 1);
    if (x < m) ops.push_back({PipelineOp::Kind::kForward, x});
    if (b >= 0 && b < m) ops.push_back({PipelineOp::Kind::kBackward, b});
    if (w >= 0 && w < m) ops.push_back({PipelineOp::Kind::kWeight, w});
  }
  return ops;
}

int max_in_flight(const std::vector<PipelineOp>& ops) {
  int now = 0, most = 0;
  for (const PipelineOp& op : ops) {
    if (op.kind == PipelineOp::Kind::kWeight) continue;
    now += op.kind == PipelineOp::Kind::kForward ? 1 : -1;
    most = std::max(most, now);
  }
  return most;
}

int max_weight_pending(const std::vector<PipelineOp>& ops) {
  int now = 0, most = 0;
  for (const PipelineOp& op : ops) {
    if (op.kind == PipelineOp::Kind::kForward) continue;
    now += op.kind == PipelineOp::Kind::kBackward ? 1 : -1;
    most = std::max(most, now);
  }
  return most;
}

double pipeline_bubble(int p, int m, int v) {
  return static_cast<double>(p - 1) / static_cast<double>(m * v + p - 1);
}

double zero_bubble_fraction(int p, int m) {
  return static_cast<double>(p - 1) / static_cast<double>(3 * m + p - 1);
}

}  // namespace foldpar
