// The counting convention of comm_stats.h as code, the counters, and the scoped counter.
#include "comm/comm_stats.h"

#include <fmt/format.h>

#include <numeric>

#include "comm/communicator.h"
#include "core/check.h"

namespace foldpar {

namespace {

// Elements of a forward ring over `counts` (all_gather_v direction): rank p forwards every
// block except its successor's and receives every block except its own.
OpTraffic ring_gather(std::span<const size_t> counts, int p, int n_ranks) {
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  return {total - counts[(p + 1) % n_ranks], total - counts[p]};
}
// The adjoint: block b starts at b+1 and ends at b.
OpTraffic ring_scatter(std::span<const size_t> counts, int p, int n_ranks) {
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  return {total - counts[p], total - counts[(p + n_ranks - 1) % n_ranks]};
}

OpTraffic traffic_elements(const CommOp& op, int p, int n_ranks) {
  const uint64_t n = op.count;
  const uint64_t others = static_cast<uint64_t>(n_ranks - 1);
  const int before_root = (op.root + n_ranks - 1) % n_ranks;
  switch (op.kind) {
    case CommOpKind::kBroadcast: return {p == before_root ? 0 : n, p == op.root ? 0 : n};
    case CommOpKind::kReduce: return {p == op.root ? 0 : n, p == before_root ? 0 : n};
    case CommOpKind::kAllReduce: {
      // Ring reduce-scatter then ring all-gather over blocks b[i] = n/N (+1 for i < n mod N).
      const auto block = [&](int i) { return n / n_ranks + (static_cast<uint64_t>(i) < n % n_ranks ? 1 : 0); };
      const int next = (p + 1) % n_ranks, prev = (p + n_ranks - 1) % n_ranks;
      return {2 * n - block(p) - block(next), 2 * n - block(prev) - block(p)};
    }
    case CommOpKind::kAllGather:
    case CommOpKind::kReduceScatter:
    case CommOpKind::kAllToAll: return {others * n, others * n};
    case CommOpKind::kAllGatherV: return ring_gather(op.counts, p, n_ranks);
    case CommOpKind::kReduceScatterV: return ring_scatter(op.counts, p, n_ranks);
    case CommOpKind::kSend: return {op.peer == p ? 0 : n, 0};
    case CommOpKind::kRecv: return {0, op.source == p ? 0 : n};
    case CommOpKind::kSendRecv: return {op.peer == p ? 0 : n, op.source == p ? 0 : n};
    case CommOpKind::kBarrier: return {0, 0};
  }
  return {0, 0};
}

}  // namespace

OpTraffic ring_traffic(const CommOp& op, int rank, int size) {
  FP_CHECK(size >= 1 && rank >= 0 && rank < size, "rank {} of {}", rank, size);
  const OpTraffic elements = traffic_elements(op, rank, size);
  const uint64_t beta = dtype_size(op.dtype);
  return {elements.bytes_sent * beta, elements.bytes_received * beta};
}

OpCounters CommStats::total() const {
  OpCounters sum;
  for (const OpCounters& c : ops_) {
    sum.calls += c.calls;
    sum.bytes_sent += c.bytes_sent;
    sum.bytes_received += c.bytes_received;
  }
  return sum;
}

void CommStats::record(CommOpKind kind, const OpTraffic& traffic) {
  OpCounters& c = ops_[static_cast<int>(kind)];
  c.calls += 1;
  c.bytes_sent += traffic.bytes_sent;
  c.bytes_received += traffic.bytes_received;
}

CommStats& CommStats::operator+=(const CommStats& other) {
  for (int i = 0; i < kNumCommOpKinds; ++i) {
    ops_[i].calls += other.ops_[i].calls;
    ops_[i].bytes_sent += other.ops_[i].bytes_sent;
    ops_[i].bytes_received += other.ops_[i].bytes_received;
  }
  return *this;
}

CommStats CommStats::operator-(const CommStats& other) const {
  CommStats diff;
  for (int i = 0; i < kNumCommOpKinds; ++i) {
    diff.ops_[i].calls = ops_[i].calls - other.ops_[i].calls;
    diff.ops_[i].bytes_sent = ops_[i].bytes_sent - other.ops_[i].bytes_sent;
    diff.ops_[i].bytes_received = ops_[i].bytes_received - other.ops_[i].bytes_received;
  }
  return diff;
}

std::string CommStats::to_string() const {
  std::string out;
  for (int i = 0; i < kNumCommOpKinds; ++i) {
    const OpCounters& c = ops_[i];
    if (c.calls == 0) continue;
    out += fmt::format("{}: {} calls, sent {} B, received {} B\n", comm_op_name(static_cast<CommOpKind>(i)),
                       c.calls, c.bytes_sent, c.bytes_received);
  }
  return out;
}

ScopedCommCounter::ScopedCommCounter(const Communicator& comm) : ScopedCommCounter({&comm}) {}

ScopedCommCounter::ScopedCommCounter(std::initializer_list<const Communicator*> comms)
    : ScopedCommCounter(std::vector<const Communicator*>(comms)) {}

ScopedCommCounter::ScopedCommCounter(const std::vector<const Communicator*>& comms) {
  for (const Communicator* comm : comms) {
    FP_CHECK(comm != nullptr);
    start_.emplace_back(comm, comm->stats());
  }
}

CommStats ScopedCommCounter::delta() const {
  CommStats sum;
  for (const auto& [comm, start] : start_) sum += comm->stats() - start;
  return sum;
}

CommStats ScopedCommCounter::delta(const Communicator& comm) const {
  for (const auto& [watched, start] : start_) {
    if (watched == &comm) return comm.stats() - start;
  }
  FP_CHECK(false, "communicator {} is not watched by this counter", comm.describe());
  return {};
}

}  // namespace foldpar
