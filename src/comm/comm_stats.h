// Traffic accounting: what every operation of a communicator moved, per operation kind, and
// a scoped counter that reads exactly what a block of code moved. Schedules assert their
// traffic against the formulas of docs/tsp.md section 7 with these counters, so the counting
// convention below is a contract: it changes only together with every test that uses it.
//
// Convention. The layer counts, for THIS rank, the payload bytes that a standard forward
// ring (rank p sends to p+1 and receives from p-1, ranks mod N) or chain would move,
// whatever algorithm the backend actually runs. Metadata (checking-mode descriptors,
// watchdog messages) is never counted. A transfer between a rank and itself is a local copy
// and counts 0 bytes. Every call counts once in `calls`, zero-sized ones included.
// With N = communicator size, p = this rank, beta = dtype_size(dtype), next = p+1 mod N,
// prev = p-1 mod N, all byte counts are the element counts below times beta:
//
//   operation                    sent by rank p                  received by rank p
//   broadcast(n, root)           n unless p == root-1 mod N      n unless p == root
//   reduce(n, root)              n unless p == root              n unless p == root-1 mod N
//   all_reduce(n)                2n - b[p] - b[next]             2n - b[prev] - b[p]
//   all_gather(c), result N*c    (N-1) c                         (N-1) c
//   all_gather_v(c[]), C=sum c   C - c[next]                     C - c[p]
//   reduce_scatter(c), N*c in    (N-1) c                         (N-1) c
//   reduce_scatter_v(c[])        C - c[p]                        C - c[prev]
//   all_to_all(c per peer)       (N-1) c                         (N-1) c
//   send(n, peer)                n unless peer == p              0
//   recv(n, source)              0                               n unless source == p
//   send_recv(n, peer, source)   n unless peer == p              n unless source == p
//   barrier                      0                               0
//
// Why these: broadcast is a pipelined chain root -> root+1 -> ... -> root-1 (what NCCL
// runs for large messages): every rank but the root receives n, every rank but the last
// forwards n. Reduce is its adjoint, the same chain reversed. So D broadcasts (or reduces)
// with roots 0..D-1 of s elements each cost every rank exactly (D-1) s each way, which is
// docs/tsp.md section 7's "(D-1)/D of the weights per rank". All-gather is the forward ring (rank p
// forwards every block except its successor's); reduce-scatter is its adjoint (block b
// starts at b+1 and ends at b). All-reduce is a ring reduce-scatter followed by a ring
// all-gather of the n elements cut into N contiguous blocks b[0..N-1], the first n mod N of
// them one element longer: when N divides n both directions are 2 (N-1)/N n exactly. These
// are also the "bus bytes" of the nccl-tests convention, so busbw = counted bytes / time.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm_op.h"

namespace foldpar {

class Communicator;

struct OpCounters {
  uint64_t calls = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;

  friend bool operator==(const OpCounters&, const OpCounters&) = default;
};

// What one rank counts for one operation, by the convention above.
struct OpTraffic {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
};
// The convention as code: bytes of `op` for rank `rank` of a communicator of `size` ranks.
// (Tests check it against the table above written out by hand, not against itself.)
OpTraffic ring_traffic(const CommOp& op, int rank, int size);

// Counters of one communicator (or a sum of several), one row per operation kind.
class CommStats {
 public:
  const OpCounters& op(CommOpKind kind) const { return ops_[static_cast<int>(kind)]; }
  OpCounters total() const;  // summed over kinds
  void record(CommOpKind kind, const OpTraffic& traffic);

  CommStats& operator+=(const CommStats& other);
  CommStats operator-(const CommStats& other) const;  // per-row difference (later - earlier)
  friend bool operator==(const CommStats&, const CommStats&) = default;

  // One line per kind that was called: "all_gather: 4 calls, sent 384 B, received 384 B".
  std::string to_string() const;

 private:
  std::array<OpCounters, kNumCommOpKinds> ops_{};
};

// Snapshots the counters of one or more communicators at construction; delta() returns what
// they recorded since, summed over them. Read it on the same thread that runs the operations.
//   ScopedCommCounter counter(tsp);  run_attention(...);  EXPECT_EQ(counter.delta().op(...), ...)
class ScopedCommCounter {
 public:
  explicit ScopedCommCounter(const Communicator& comm);
  explicit ScopedCommCounter(std::initializer_list<const Communicator*> comms);
  explicit ScopedCommCounter(const std::vector<const Communicator*>& comms);

  CommStats delta() const;
  // What one of the watched communicators recorded since construction.
  CommStats delta(const Communicator& comm) const;

 private:
  std::vector<std::pair<const Communicator*, CommStats>> start_;
};

}  // namespace foldpar
