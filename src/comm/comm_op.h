// The vocabulary of the communication layer: operation kinds, reduction operators, the
// optional device stream, and CommOp, the one descriptor every entry point of Communicator
// (comm/communicator.h) fills in and funnels through a single validated path. No backend
// types (MPI, NCCL) appear here; a backend translates a CommOp into its own calls.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "tensor/dtype.h"

namespace foldpar {

// Every operation the layer offers, in the order of CommStats' rows.
enum class CommOpKind : uint8_t {
  kBroadcast,
  kReduce,
  kAllReduce,
  kAllGather,       // equal counts
  kAllGatherV,      // variable counts
  kReduceScatter,   // equal counts
  kReduceScatterV,  // variable counts
  kAllToAll,
  kSend,
  kRecv,
  kSendRecv,        // paired send and receive, one ring step
  kBarrier,
};
inline constexpr int kNumCommOpKinds = static_cast<int>(CommOpKind::kBarrier) + 1;

// "all_gather", "send_recv", ...: the standard names, used in every message.
const char* comm_op_name(CommOpKind kind);
// Collectives must be called by every rank of the communicator in the same order; the
// point-to-point kinds (send, recv, send_recv) involve only the named peers.
constexpr bool is_collective(CommOpKind kind) {
  return kind != CommOpKind::kSend && kind != CommOpKind::kRecv && kind != CommOpKind::kSendRecv;
}

// Reductions. Integer and floating types reduce in their own type, except bf16, which is
// widened to f32, reduced in f32 and rounded to bf16 once at the end.
enum class ReduceOp : uint8_t { kSum, kMax };
const char* reduce_op_name(ReduceOp op);

// The queue a device backend enqueues on (a cudaStream_t for NCCL). Null means "the
// backend's default"; host backends (MPI) run on the calling thread and accept only null.
struct CommStream {
  void* native = nullptr;
};

// What an operation is for, in its caller's words, for the watchdog's report of one that
// never completes (comm/mpi_watchdog.h), e.g. "pipeline: stage 1 (world rank 3, tsp index 1)
// never sent the activation of micro-batch 2 to stage 2". `format` is fmt syntax over the
// six `args` ({0}..{5}) and `text` ({6}); unused ones are ignored. Plain values copied with
// the op: giving an operation a purpose allocates nothing; the text is made only when a
// report needs it. Both strings must outlive the operation.
struct CommPurpose {
  const char* format = nullptr;  // null: no purpose
  std::array<int64_t, 6> args{};
  const char* text = "";
};
// The purpose's text; "" when it has none; the format itself when it does not parse.
std::string describe_purpose(const CommPurpose& purpose);

// One operation as the entry points describe it. Field meaning per kind ("N" = the
// communicator size, "beta" = dtype_size(dtype)):
//   broadcast        recv_buf: count elements, in and out (in at root)
//   reduce           send_buf: count; recv_buf: count, significant at root only
//   all_reduce       send_buf, recv_buf: count
//   all_gather       send_buf: count (this rank's block); recv_buf: N * count
//   all_gather_v     send_buf: counts[rank]; recv_buf: sum(counts), rank r's block at
//                    offset counts[0] + ... + counts[r-1]
//   reduce_scatter   send_buf: N * count; recv_buf: count (block `rank` of the reduction)
//   reduce_scatter_v send_buf: sum(counts); recv_buf: counts[rank]
//   all_to_all       send_buf: N * count, block r goes to rank r; recv_buf: N * count,
//                    block r came from rank r
//   send             send_buf: count, to `peer`
//   recv             recv_buf: count, from `source`
//   send_recv        send_buf: count to `peer`; recv_buf: count from `source`
//   barrier          nothing
struct CommOp {
  CommOpKind kind = CommOpKind::kBarrier;
  const void* send_buf = nullptr;
  void* recv_buf = nullptr;
  size_t count = 0;
  std::span<const size_t> counts;  // all_gather_v, reduce_scatter_v: one entry per rank
  DType dtype = DType::kF32;
  ReduceOp reduce_op = ReduceOp::kSum;
  int root = 0;     // broadcast, reduce
  int peer = -1;    // send, send_recv: the destination
  int source = -1;  // recv, send_recv: the source
  // send, recv: messages of one source match receives of the same tag in order; 0 for
  // everything but the interleaved pipeline's chunk streams (parallel/pipeline/), 0..32767.
  // MPI only: NCCL matches in call order and refuses a non-zero tag.
  int tag = 0;
  CommStream stream;
  CommPurpose purpose;  // optional; only the watchdog reads it
  // Assigned by the communicator when the operation is submitted: the 1-based sequence
  // number of this collective on its communicator (or of this point-to-point operation
  // among the communicator's point-to-point operations).
  uint64_t seq = 0;
};

}  // namespace foldpar
