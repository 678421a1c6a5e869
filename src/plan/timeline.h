// The timeline: one rank's step, as a list of events in program order (compute ops,
// communication starts and waits), simulated on a compute stream and communication streams
// priced by a Hardware description; its step time, exposed communication and critical path;
// the simulated timeline as a Chrome trace; and a few lines on what bounds it.
//
// The input types are this file's own (no backend, comm or tensor types): whoever records a
// dry run converts its records into a RankTrace. Depends only on core and plan/hardware.h.
//
// Assumptions of the simulation (each rank is simulated alone):
//  - Peers are symmetric and present: a transfer's peer posts it at the same time, so a
//    transfer starts as soon as this rank posts it and a slot of its link class is free.
//    Ranks that differ (zigzag ends) are simulated one by one; the slowest gives the step.
//  - Except point-to-point transfers between ranks simulated together (simulate_coupled:
//    the stages of a pipeline, the ranks of a TSP ring): a send and the receive it matches
//    (the n-th send from A to B on a communicator matches B's n-th receive from A, MPI's
//    order) start when the later of the two is posted and end together; a wait on one
//    blocks until then, which is how a stage waits for its neighbours (the pipeline's
//    bubble) and a ring step for the neighbour still computing the step before. A
//    send_recv is a send to its peer and a receive from its source, coupled when both are
//    simulated (the set must then hold the whole ring, or its ranks wait for ever, named):
//    it starts when the later of its two matches does. Likewise a collective whose members
//    (CommStart::members) are all simulated: the n-th collective of a communicator's member
//    set on each member starts when the last of them posts it. They take no link slot.
//  - One compute stream runs compute events in program order, one at a time.
//  - One communication stream per link class (intra-node, inter-node) with
//    Hardware::*_concurrency slots; transfers take slots in posting order (first free slot),
//    each slot carrying one transfer at the link's full per-direction bandwidth. Links are
//    full duplex: a slot's two directions are busy apart, so a send (bytes out only) and a
//    receive (bytes in only) run side by side on one slot, while a collective or a
//    send_recv (bytes both ways) takes both directions.
//  - A wait blocks the compute stream until the transfer it names has finished; a blocking
//    operation is a start followed at once by its wait. Where the link's copy share
//    (Hardware::intra/inter_node_copy_share) is above 0, the wait also lasts at least that
//    share of the transfer's time: the cores that compute move the bytes (a CPU's MPI over
//    shared memory, TCP), so only the rest of the transfer overlaps computation.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "core/status.h"
#include "plan/hardware.h"

namespace foldpar {

// ---- input ------------------------------------------------------------------------------

enum class ComputeClass { kGemm, kAttentionFwd, kAttentionBwd, kTokenwise, kOptimizer, kOther };
enum class MathDType { kBF16, kF32 };  // the dtype the op computes in (which peak applies)

struct GemmShape {
  int64_t m = 0, n = 0, k = 0;  // C[m, n] = A[m, k] B[k, n]
};
struct AttentionShape {
  int64_t batch = 0, seq_q = 0, seq_k = 0, heads = 0, head_dim = 0;  // B, Sq, Sk, n_h, d
};
struct TokenwiseShape {
  int64_t rows = 0, width = 0;  // rows x width elements (norms, activations, adds, optimizer)
};

// One compute op. Priced as a roofline: max(flops / rate, bytes / memory bandwidth), where
// rate = peak(dtype) x the efficiency of its class (GEMM: Hardware::gemm_efficiency of
// min(m, n, k); attention: attention_fwd_rate / attention_bwd_rate of its seq_k; token-wise, optimizer and
// other: matmul_efficiency) and memory bandwidth is memory_gb_per_s for GEMMs and attention,
// and for every other op Hardware::tokenwise_gb_per_s(op) (its calibrated rate, else
// memory_gb_per_s); the memory term applies when that bandwidth is known.
struct ComputeEvent {
  std::string op;  // e.g. "matmul", "attention_forward", "rmsnorm_forward"
  ComputeClass op_class = ComputeClass::kOther;
  double flops = 0;
  double bytes = 0;  // read + written
  MathDType dtype = MathDType::kF32;
  GemmShape gemm;            // op_class == kGemm
  AttentionShape attention;  // kAttentionFwd, kAttentionBwd
  TokenwiseShape tokenwise;  // kTokenwise, kOptimizer
};

enum class CommKind { kBroadcast, kReduce, kAllReduce, kAllGather, kReduceScatter, kAllToAll, kSend, kRecv, kSendRecv, kBarrier };
enum class LinkClass { kIntraNode, kInterNode };

// Posting one transfer. bytes_sent / bytes_received: this rank's bytes by comm_stats.h's
// counting convention (the standard ring or chain).
struct CommStart {
  int64_t request = 0;       // unique in the trace; the wait names it
  CommKind kind = CommKind::kAllReduce;
  std::string communicator;  // its axis name, e.g. "tsp", "dp"
  int comm_size = 1;         // N, the communicator's ranks
  LinkClass link = LinkClass::kIntraNode;  // see link_class()
  uint64_t bytes_sent = 0, bytes_received = 0;
  bool blocking = false;     // start + wait at once (no CommWait follows)
  int peer = -1;             // kSend, kSendRecv: the destination's world rank; kRecv: the source's; else -1
  int source = -1;           // kSendRecv: the source's world rank; else -1
  int tag = 0;               // kSend, kRecv, kSendRecv: the message stream (CommOp::tag)
  std::vector<int> members;  // collectives: the communicator's world ranks, for simulate_coupled; may be empty
};
struct CommWait {
  int64_t request = 0;
};

using TimelineEvent = std::variant<ComputeEvent, CommStart, CommWait>;

struct RankTrace {
  int rank = 0;
  std::vector<TimelineEvent> events;  // program order
};

// kInterNode when the communicator's world ranks span more than one node (node = world rank /
// devices_per_node), else kIntraNode. invalid_argument for no ranks or devices_per_node < 1.
Result<LinkClass> link_class(const std::vector<int>& world_ranks, int devices_per_node);

// ---- pricing ----------------------------------------------------------------------------

// Seconds of one compute op on `hw` (the roofline above).
double compute_seconds(const ComputeEvent& e, const Hardware& hw);
// True when the memory term of the roofline is the larger one.
bool memory_bound(const ComputeEvent& e, const Hardware& hw);

// Latency steps of one operation over N ranks (ring algorithms; 0 when N == 1):
//   all_gather, reduce_scatter, all_to_all   N - 1      (ring / pairwise exchange)
//   all_reduce                               2 (N - 1)  (ring reduce-scatter + all-gather)
//   broadcast, reduce                        N - 1      (pipelined chain)
//   send, recv, send_recv                    1
//   barrier                                  ceil(log2 N)  (dissemination)
int latency_steps(CommKind kind, int comm_size);
// Seconds of one transfer: latency_steps x the link's latency + max(bytes_sent,
// bytes_received) / (the link's per-direction bandwidth x Hardware::collective_efficiency_of
// the kind). Links are full duplex, and the counted bytes are the ring's per-rank bytes, so
// with efficiency 1 this is the ring's time. Where the link has a size table for the kind
// (Hardware::*_gb_per_s_by_bytes: "i" + kind for a non-blocking start, else the kind), its
// rate at those bytes replaces the bandwidth x efficiency. 0 when N == 1.
double transfer_seconds(const CommStart& s, const Hardware& hw);

// ---- simulation -------------------------------------------------------------------------

enum class Stream { kCompute, kCommIntra, kCommInter };

// One interval of the simulated timeline.
struct TimelineOp {
  enum class Kind { kCompute, kTransfer, kStall };  // kStall: compute waiting on `request`
  Kind kind = Kind::kCompute;
  std::string name;          // op name, comm kind name, or "wait <kind>"
  std::string op_class;      // compute class name or comm kind name
  std::string communicator;  // transfers and stalls
  Stream stream = Stream::kCompute;
  int slot = 0;              // the link slot of a transfer
  double start = 0, end = 0;  // seconds from the step's start
  double flops = 0, bytes = 0;
  uint64_t bytes_sent = 0, bytes_received = 0;
  int64_t request = -1;
  bool memory_bound = false;  // compute ops
};

// Totals per op kind (compute class or comm kind) and communicator ("" for compute).
struct KindTotals {
  std::string kind, communicator;
  bool transfer = false;
  int64_t count = 0;
  double busy_s = 0;     // sum of durations
  double exposed_s = 0;  // compute stalled waiting on these transfers
  double flops = 0, bytes = 0;  // bytes: compute read+written; transfers max(sent, received)
};

struct RankTimeline {
  int rank = 0;
  double step_s = 0;          // when the compute stream ends (every transfer is waited on)
  double compute_s = 0;       // sum of compute op durations
  double exposed_comm_s = 0;  // sum of stalls: step_s = compute_s + exposed_comm_s
  double comm_busy_s = 0;     // sum of transfer durations (over all slots and links)
  double memory_bound_s = 0;  // the part of compute_s in memory-bound ops
  std::vector<KindTotals> by_kind;      // compute kinds first, then transfers, in first-seen order
  std::vector<TimelineOp> ops;          // compute ops and stalls in program order, then transfers in posting order
  std::vector<TimelineOp> critical_path;  // from 0 to step_s: compute ops and the transfers that stalled compute
};

// invalid_argument for a duplicate request id, a wait on an unknown or already waited
// request, a wait after a blocking start, a request never waited, or a negative figure.
Result<RankTimeline> simulate_rank(const RankTrace& trace, const Hardware& hw);
// simulate_rank of each trace (the distinct ranks of a mesh); the first error, naming its rank.
Result<std::vector<RankTimeline>> simulate_ranks(const std::vector<RankTrace>& traces, const Hardware& hw);
// The traces simulated together (RankTrace::rank their world ranks, distinct): sends and
// receives between them are matched as the header says; everything else as simulate_rank.
// invalid_argument as simulate_rank, and for ranks that wait on each other for ever (a
// receive whose send never comes), naming the rank, the request and its peer.
Result<std::vector<RankTimeline>> simulate_coupled(const std::vector<RankTrace>& traces, const Hardware& hw);

// The Chrome trace format (JSON object with traceEvents; open in Perfetto or
// chrome://tracing): one "X" event per op, pid = rank, tid = 0 compute, 1 + slot comm
// intra-node, 1 + intra slots + slot comm inter-node, with thread names; args carry flops,
// bytes, communicator and request. Times in microseconds.
std::string chrome_trace_json(const std::vector<RankTimeline>& ranks);

// A few lines saying what bounds the slowest of `ranks`: compute (its share of the step),
// memory bandwidth (the memory-bound ops' share), or the collective and axis with the most
// exposed time (its seconds and share), then the largest exposed collectives.
std::string explain_timeline(const std::vector<RankTimeline>& ranks);

const char* compute_class_name(ComputeClass c);
const char* comm_kind_name(CommKind k);
const char* link_class_name(LinkClass l);

}  // namespace foldpar
