// Communicator: a group of ranks and the operations among them, on raw buffers, element
// counts and dtypes. One abstract interface; the MPI backend (comm/mpi_runtime.h) implements
// it today and an NCCL backend will implement the same calls (hence the optional stream).
// Every public entry point fills in a CommOp and funnels it through one path that checks
// the contract, numbers the operation, counts its bytes (comm/comm_stats.h) and hands it to
// the backend. Nothing here is global: communicators are objects that callers pass around.
//
// Contract of every operation (the same as NCCL's, see nccl.h):
//  - Collectives (all but send, recv, send_recv) must be called by every rank of the
//    communicator, in the same order, with the same count, dtype, reduction and root
//    (and the same counts[] for the _v forms). Blocking and non-blocking calls share that
//    order. FOLDPAR_COMM_CHECK=1 verifies it before each collective (docs/comm.md).
//  - Counts are in elements of `dtype`. Zero counts are valid and still synchronize the
//    collective. A buffer may be null only where its count is 0 (or where it is not used:
//    recv_buf of reduce on a non-root rank). The counts[] of the _v forms is read during
//    the call only, also for the non-blocking forms.
//  - In place: all_reduce and reduce (at the root) when send_buf == recv_buf; all_gather
//    when send_buf == recv_buf + rank * count (all_gather_v: + the rank's offset);
//    reduce_scatter when recv_buf == send_buf + rank * count (reduce_scatter_v: + offset),
//    after which the rest of send_buf is unspecified. Any other overlap between the send and
//    receive ranges is a bug and fails an FP_CHECK, as do a root, peer or source out of
//    range and a counts[] of the wrong length.
//  - Non-blocking forms (i-prefixed) return a CommRequest at once. Until its wait() returns
//    or test() reports done, the send buffer must not be modified and the receive buffer
//    must not be read or written. Requests may be completed in any order, but before their
//    communicator is destroyed. The MPI backend
//    progresses transfers only inside MPI calls: a schedule that overlaps a transfer with
//    computation should call test() between pieces of the computation (docs/comm.md).
//  - Return values: a Status that is not ok means the backend cannot run this request
//    (kUnimplemented: e.g. a stream given to the MPI backend, or a count beyond its limit).
//    Failures of the library or of a peer do not return: they print the operation, rank
//    and host and abort the whole job, as does the watchdog for an operation that never
//    completes. A communicator is used by one thread at a time.
//  - Blocking send may wait until the matching recv is posted; a ring step is send_recv.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/comm_op.h"
#include "comm/comm_stats.h"
#include "core/status.h"
#include "tensor/dtype.h"

namespace foldpar {

// What a backend returns for a non-blocking operation in flight.
class CommRequestImpl {
 public:
  virtual ~CommRequestImpl() = default;
  virtual Status wait() = 0;               // blocks until done
  virtual Status test(bool* done) = 0;     // advances the transfer; *done once complete
};

// Handle of a non-blocking operation. Move-only. Destroying a request that is still
// pending is a bug (the transfer would keep writing into the caller's buffers): FP_CHECK.
class [[nodiscard]] CommRequest {
 public:
  CommRequest() = default;  // nothing in flight: wait() returns ok at once
  explicit CommRequest(std::unique_ptr<CommRequestImpl> impl);
  static CommRequest failed(Status status);  // completes at once with `status`
  CommRequest(CommRequest&& other) noexcept;
  CommRequest& operator=(CommRequest&& other) noexcept;
  ~CommRequest();

  // Blocks until the operation completes; returns its Status. Calling it again returns the
  // same Status.
  Status wait();
  // Never blocks. Sets *done when the operation has completed and then returns its Status.
  Status test(bool* done);
  bool pending() const { return impl_ != nullptr; }

 private:
  std::unique_ptr<CommRequestImpl> impl_;
  Status status_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The axis or role: "world", "tsp", "tp", ...
  const std::string& name() const { return name_; }
  // World rank of each member, indexed by rank in this communicator.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  // "tsp (world ranks 0-3)": how messages name this communicator.
  std::string describe() const;

  // Counters of every operation submitted on this communicator (comm/comm_stats.h).
  const CommStats& stats() const { return stats_; }
  // Seconds the calling thread spent blocked in this communicator's operations of `kind`: the
  // whole of each blocking call and of each request's wait() (test() is not counted). A
  // measurement (bench-layouts --profile puts it beside the plan's simulated waits), never
  // part of stats(), which a dry run reproduces exactly.
  double blocked_seconds(CommOpKind kind) const { return blocked_s_[static_cast<int>(kind)]; }
  // Collectives submitted so far: the sequence number of the latest one (0 before any).
  uint64_t collectives_submitted() const { return collective_seq_.load(std::memory_order_relaxed); }

  // Collective over this communicator: returns the communicator of the ranks that passed
  // the same color (>= 0), ranked by key, then by rank here. Named `name`.
  virtual std::unique_ptr<Communicator> split(int color, int key, std::string name) = 0;

  // ---- collectives; parameter order follows nccl.h ----
  // buf: [count], the root's contents are copied to every rank.
  Status broadcast(void* buf, size_t count, DType dtype, int root, CommStream stream = {});
  // recv_buf (root only): [count] = op over ranks of send_buf [count].
  Status reduce(const void* send_buf, void* recv_buf, size_t count, DType dtype, ReduceOp op, int root,
                CommStream stream = {});
  // recv_buf [count] = op over ranks of send_buf [count], on every rank.
  Status all_reduce(const void* send_buf, void* recv_buf, size_t count, DType dtype, ReduceOp op,
                    CommStream stream = {});
  // send_buf [count] -> recv_buf [size * count], rank r's block at r * count.
  Status all_gather(const void* send_buf, void* recv_buf, size_t count, DType dtype, CommStream stream = {});
  // send_buf [counts[rank]] -> recv_buf [sum counts], rank r's block after those of ranks < r.
  Status all_gather_v(const void* send_buf, void* recv_buf, std::span<const size_t> counts, DType dtype,
                      CommStream stream = {});
  // send_buf [size * count] -> recv_buf [count] = block `rank` of op over ranks of send_buf.
  Status reduce_scatter(const void* send_buf, void* recv_buf, size_t count, DType dtype, ReduceOp op,
                        CommStream stream = {});
  // send_buf [sum counts] -> recv_buf [counts[rank]]: the adjoint of all_gather_v.
  Status reduce_scatter_v(const void* send_buf, void* recv_buf, std::span<const size_t> counts, DType dtype,
                          ReduceOp op, CommStream stream = {});
  // send_buf [size * count], block r to rank r -> recv_buf [size * count], block r from rank r.
  Status all_to_all(const void* send_buf, void* recv_buf, size_t count, DType dtype, CommStream stream = {});
  Status barrier(CommStream stream = {});

  // ---- point to point: only the named ranks take part; same order between each pair ----
  Status send(const void* buf, size_t count, DType dtype, int peer, CommStream stream = {});
  Status recv(void* buf, size_t count, DType dtype, int source, CommStream stream = {});
  // One ring step: send send_buf [count] to `peer` while receiving recv_buf [count] from
  // `source` (forward ring: peer = rank+1, source = rank-1 mod size). Buffers must not overlap.
  Status send_recv(const void* send_buf, void* recv_buf, size_t count, DType dtype, int peer, int source,
                   CommStream stream = {});

  // ---- the same, non-blocking ----
  CommRequest ibroadcast(void* buf, size_t count, DType dtype, int root, CommStream stream = {});
  CommRequest ireduce(const void* send_buf, void* recv_buf, size_t count, DType dtype, ReduceOp op, int root,
                      CommStream stream = {});
  CommRequest iall_reduce(const void* send_buf, void* recv_buf, size_t count, DType dtype, ReduceOp op,
                          CommStream stream = {});
  CommRequest iall_gather(const void* send_buf, void* recv_buf, size_t count, DType dtype,
                          CommStream stream = {});
  CommRequest iall_gather_v(const void* send_buf, void* recv_buf, std::span<const size_t> counts, DType dtype,
                            CommStream stream = {});
  CommRequest ireduce_scatter(const void* send_buf, void* recv_buf, size_t count, DType dtype, ReduceOp op,
                              CommStream stream = {});
  CommRequest ireduce_scatter_v(const void* send_buf, void* recv_buf, std::span<const size_t> counts,
                                DType dtype, ReduceOp op, CommStream stream = {});
  CommRequest iall_to_all(const void* send_buf, void* recv_buf, size_t count, DType dtype,
                          CommStream stream = {});
  CommRequest ibarrier(CommStream stream = {});
  CommRequest isend(const void* buf, size_t count, DType dtype, int peer, CommStream stream = {});
  CommRequest irecv(void* buf, size_t count, DType dtype, int source, CommStream stream = {});
  CommRequest isend_recv(const void* send_buf, void* recv_buf, size_t count, DType dtype, int peer, int source,
                         CommStream stream = {});

  // The single path every entry point above takes; public so that generic code (tests,
  // benchmarks, a future op-parity harness) can drive any operation from a descriptor.
  // op.seq is assigned here.
  Status run(CommOp op);
  CommRequest start(CommOp op);
  // Several operations started together, one request each, in order: the same as starting
  // them one by one (numbering, counters, results), except that a backend may launch them
  // as one (NCCL: one ncclGroupStart/ncclGroupEnd, so B per-sequence gathers are one launch).
  // An op the backend refuses fails its request and every later one's; the earlier ones run.
  std::vector<CommRequest> start_group(std::span<const CommOp> ops);

 protected:
  Communicator(int rank, int size, std::string name, std::vector<int> world_ranks);

  // Backend hooks. `supports` runs first and may refuse (kUnimplemented); the others get a
  // validated, numbered op and count nothing themselves.
  virtual Status supports(const CommOp& op) const = 0;
  virtual Status run_validated(const CommOp& op) = 0;
  virtual CommRequest start_validated(const CommOp& op) = 0;
  // Validated, numbered ops of start_group (at least one). Default: start_validated each.
  virtual std::vector<CommRequest> start_validated_group(std::span<const CommOp> ops);

 private:
  // Validates (FP_CHECK), asks the backend, numbers and counts the op.
  Status submit(CommOp& op);

  int rank_;
  int size_;
  std::string name_;
  std::vector<int> world_ranks_;
  CommStats stats_;
  std::array<double, kNumCommOpKinds> blocked_s_{};
  std::atomic<uint64_t> collective_seq_{0};  // read by the backend's watchdog thread
  uint64_t p2p_seq_ = 0;
};

}  // namespace foldpar
