// The MPI backend of Communicator. Blocking operations call the blocking MPI collectives
// (OpenMPI's tuned algorithms); non-blocking ones the MPI_I* forms, completed by
// CommRequest::wait/test. Except reduce-scatters, which by default are foldpar's own
// pairwise exchange (CommOptions::reduce_scatter): every block posted to its owner and
// every contribution to ours received at once, point to point on a duplicate of the
// communicator, then summed on completion in rank-distance order (deterministic); and
// non-blocking reduces of 1 MiB and more, as whole buffers sent to the root. bf16 reductions widen to an f32 copy, reduce that in place with
// MPI_FLOAT and round once at the end (so the wire carries f32 for them; the counters still
// count bf16 bytes, by the convention of comm_stats.h). Every call runs under the watchdog
// when it is on, and after the checking-mode exchange when that is on.
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "comm/mpi_internal.h"
#include "comm/mpi_watchdog.h"
#include "comm/op_check.h"
#include "comm/scratch_pool.h"
#include "core/check.h"

namespace foldpar::mpi_detail {

namespace {

constexpr int kPointToPointTag = 0;
// Blocking all-reduces of at least this many bytes go through the pairwise exchange
// (all_reduce_pairwise) when reduce-scatters do; so do non-blocking reduces, as whole
// buffers to the root (post_reduce_to_root).
constexpr size_t kPairwiseAllReduceBytes = size_t{1} << 20;

bool is_reduction(CommOpKind k) {
  return k == CommOpKind::kReduce || k == CommOpKind::kAllReduce || k == CommOpKind::kReduceScatter ||
         k == CommOpKind::kReduceScatterV;
}

uint64_t total_of(std::span<const size_t> counts) {
  uint64_t total = 0;
  for (size_t c : counts) total += c;
  return total;
}

// The MPI arguments of one operation and what is left to do once MPI has completed it.
struct Plan {
  const void* send = nullptr;  // or MPI_IN_PLACE
  void* recv = nullptr;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  ScratchBuffer stage_buf;  // bf16 reductions: f32 copy of the input, reduced in place
  float* stage() const { return reinterpret_cast<float*>(stage_buf.data()); }
  std::vector<int> counts, displs;  // the _v forms
  std::vector<MPI_Request> requests = std::vector<MPI_Request>(2, MPI_REQUEST_NULL);
  std::vector<MPI_Status> statuses = std::vector<MPI_Status>(2);
  int n_requests = 1;
  // Pairwise reduce-scatter: the N-1 contributions to this rank's block, back to back in
  // rank-distance order (1, 2, ..., N-1), and where the block's input and result are.
  bool pairwise = false;
  ScratchBuffer incoming;
  const void* own_in = nullptr;
  void* own_out = nullptr;
  size_t own_count = 0;
  DType reduce_dtype = DType::kF32;  // of own_in, incoming and own_out (bf16 reduces as f32)
  // On completion: round stage[0, bf16_count) into bf16_out; move an in-place
  // reduce-scatter result from the start of the send buffer to recv_buf; check the size of
  // a received message (statuses[recv_status]).
  void* bf16_out = nullptr;
  size_t bf16_count = 0;
  const float* bf16_from = nullptr;  // null: stage()
  void* move_to = nullptr;
  const void* move_from = nullptr;
  size_t move_bytes = 0;
  int recv_status = -1;
};

void widen_bf16(const void* src, size_t n, ScratchBuffer& dst_buf) {
  dst_buf = ScratchBuffer::take(n * sizeof(float));
  auto* dst = reinterpret_cast<float*>(dst_buf.data());
  const auto* s = static_cast<const bf16*>(src);
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
}

void narrow_to_bf16(const float* src, size_t n, void* dst) {
  auto* d = static_cast<bf16*>(dst);
  for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
}

// out = own op in_1 op ... op in_k (elementwise, in that order); out may be own.
template <typename T>
void reduce_into(ReduceOp op, const T* own, const std::byte* incoming, int k, size_t n, T* out) {
  if (n > 0 && out != own) std::memcpy(out, own, n * sizeof(T));
  for (int j = 0; j < k; ++j) {
    const T* in = reinterpret_cast<const T*>(incoming) + static_cast<size_t>(j) * n;
    if (op == ReduceOp::kSum) {
      for (size_t i = 0; i < n; ++i) out[i] += in[i];
    } else {
      for (size_t i = 0; i < n; ++i) out[i] = std::max(out[i], in[i]);
    }
  }
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

class MpiCommunicator;

// Registers an operation with the watchdog for the life of a blocking call.
class WatchdogScope {
 public:
  WatchdogScope(MpiWatchdog* watchdog, const Communicator& comm, uint64_t key, const CommOp& op)
      : watchdog_(watchdog), token_(watchdog ? watchdog->begin(comm, key, op, /*waiting=*/true) : 0) {}
  ~WatchdogScope() {
    if (watchdog_ != nullptr) watchdog_->end(token_);
  }
  WatchdogScope(const WatchdogScope&) = delete;
  WatchdogScope& operator=(const WatchdogScope&) = delete;

 private:
  MpiWatchdog* watchdog_;
  uint64_t token_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MpiContext* ctx, MPI_Comm comm, std::string name, std::vector<int> world_ranks, int rank, int size);
  ~MpiCommunicator() override;

  std::unique_ptr<Communicator> split(int color, int key, std::string name) override;
  void finish(const CommOp& op, Plan& plan) const;

 protected:
  Status supports(const CommOp& op) const override;
  Status run_validated(const CommOp& op) override;
  CommRequest start_validated(const CommOp& op) override;

 private:
  void prepare(const CommOp& op, Plan& plan) const;
  void prepare_reduction(const CommOp& op, Plan& plan) const;
  void post(const CommOp& op, Plan& plan, bool blocking);
  void post_pairwise_reduce_scatter(const CommOp& op, Plan& plan);
  void post_reduce_to_root(const CommOp& op, Plan& plan);
  void post_pairwise(const CommOp& op, Plan& plan, const void* input, const std::vector<size_t>& counts,
                     const std::vector<size_t>& offsets, void* own_out);
  void all_reduce_pairwise(const CommOp& op, Plan& plan);
  void reduce_pairwise(const CommOp& op, Plan& plan) const;
  void check_collective(const CommOp& op);

  MpiContext* ctx_;
  MPI_Comm comm_;
  MPI_Comm check_comm_ = MPI_COMM_NULL;  // checking-mode exchanges, apart from user traffic
  MPI_Comm pairwise_comm_ = MPI_COMM_NULL;  // foldpar's own reductions, apart from user traffic
  uint64_t key_ = 0;                     // the watchdog's name for this communicator
};

class MpiRequest final : public CommRequestImpl {
 public:
  MpiRequest(const MpiCommunicator& comm, const CommOp& op, std::unique_ptr<Plan> plan, MpiWatchdog* watchdog,
             uint64_t token)
      : comm_(comm), op_(op), plan_(std::move(plan)), watchdog_(watchdog), token_(token) {
    op_.counts = {};  // the caller's counts[] need not outlive the call; the plan has them
  }
  Status wait() override {
    if (watchdog_ != nullptr) watchdog_->wait_begins(token_);
    FP_MPI_CHECK(MPI_Waitall(plan_->n_requests, plan_->requests.data(), plan_->statuses.data()));
    complete();
    return Status::ok_status();
  }
  Status test(bool* done) override {
    int flag = 0;
    FP_MPI_CHECK(MPI_Testall(plan_->n_requests, plan_->requests.data(), &flag, plan_->statuses.data()));
    if (flag) complete();
    *done = flag != 0;
    return Status::ok_status();
  }

 private:
  void complete() {
    comm_.finish(op_, *plan_);
    if (watchdog_ != nullptr) watchdog_->end(token_);
  }
  const MpiCommunicator& comm_;
  CommOp op_;
  std::unique_ptr<Plan> plan_;
  MpiWatchdog* watchdog_;
  uint64_t token_;
};

MpiCommunicator::MpiCommunicator(MpiContext* ctx, MPI_Comm comm, std::string name, std::vector<int> world_ranks,
                                 int rank, int size)
    : Communicator(rank, size, std::move(name), std::move(world_ranks)), ctx_(ctx), comm_(comm) {
  FP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  FP_MPI_CHECK(MPI_Comm_dup(comm_, &check_comm_));
  FP_MPI_CHECK(MPI_Comm_set_errhandler(check_comm_, MPI_ERRORS_RETURN));
  FP_MPI_CHECK(MPI_Comm_dup(comm_, &pairwise_comm_));
  FP_MPI_CHECK(MPI_Comm_set_errhandler(pairwise_comm_, MPI_ERRORS_RETURN));
  // Members agree on the key: same name, same members, same count of such communicators
  // created before (creation is collective over the members).
  std::string id = this->name();
  for (int w : this->world_ranks()) id += fmt::format(",{}", w);
  const int ordinal = ctx_->comm_ordinals[id]++;
  key_ = fnv1a(fmt::format("{}#{}", id, ordinal));
  ctx_->live_comms.fetch_add(1);
  if (ctx_->watchdog != nullptr) ctx_->watchdog->add_comm(key_, this);
}

MpiCommunicator::~MpiCommunicator() {
  if (ctx_->watchdog != nullptr) ctx_->watchdog->remove_comm(key_);
  FP_MPI_CHECK(MPI_Comm_free(&check_comm_));
  FP_MPI_CHECK(MPI_Comm_free(&pairwise_comm_));
  if (comm_ != MPI_COMM_WORLD) FP_MPI_CHECK(MPI_Comm_free(&comm_));
  ctx_->live_comms.fetch_sub(1);
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key, std::string name) {
  FP_CHECK(color >= 0, "split of {}: color {} must be >= 0", describe(), color);
  MPI_Comm part = MPI_COMM_NULL;
  FP_MPI_CHECK(MPI_Comm_split(comm_, color, key, &part));
  return make_mpi_communicator(ctx_, part, std::move(name));
}

Status MpiCommunicator::supports(const CommOp& op) const {
  if (op.stream.native != nullptr) {
    return unimplemented("the MPI backend runs on the calling thread and takes no stream; pass CommStream{{}}");
  }
  uint64_t largest = op.count;  // elements in the largest buffer MPI addresses with an int
  if (op.kind == CommOpKind::kAllGather || op.kind == CommOpKind::kReduceScatter || op.kind == CommOpKind::kAllToAll) {
    largest = op.count * static_cast<uint64_t>(size());
  } else if (op.kind == CommOpKind::kAllGatherV || op.kind == CommOpKind::kReduceScatterV) {
    largest = total_of(op.counts);
  }
  if (largest > static_cast<uint64_t>(INT_MAX)) {
    return unimplemented("a buffer of {} elements exceeds the MPI backend's limit of {} elements", largest, INT_MAX);
  }
  return Status::ok_status();
}

void MpiCommunicator::prepare_reduction(const CommOp& op, Plan& plan) const {
  const size_t beta = dtype_size(op.dtype);
  const bool scatter = op.kind == CommOpKind::kReduceScatter || op.kind == CommOpKind::kReduceScatterV;
  const uint64_t n_in = op.kind == CommOpKind::kReduceScatter ? op.count * size() : op.count;
  const uint64_t mine = op.kind == CommOpKind::kReduceScatterV ? op.counts[rank()] : op.count;
  const bool has_output = op.kind != CommOpKind::kReduce || rank() == op.root;
  if (op.dtype == DType::kBF16) {  // reduce an f32 copy in place, round once
    widen_bf16(op.send_buf, op.kind == CommOpKind::kReduceScatterV ? total_of(op.counts) : n_in, plan.stage_buf);
    plan.type = MPI_FLOAT;
    plan.send = has_output ? MPI_IN_PLACE : plan.stage();
    plan.recv = has_output ? plan.stage() : nullptr;
    if (has_output) {
      plan.bf16_out = op.recv_buf;
      plan.bf16_count = mine;
    }
    return;
  }
  plan.send = op.send_buf;
  plan.recv = op.recv_buf;
  if (!scatter) {
    if (has_output && op.send_buf == op.recv_buf) plan.send = MPI_IN_PLACE;
    return;
  }
  const uint64_t offset = op.kind == CommOpKind::kReduceScatter ? op.count * rank() : total_of(op.counts.first(rank()));
  if (op.recv_buf == static_cast<const char*>(op.send_buf) + offset * beta && mine > 0) {
    // In place: MPI reduces the whole send buffer and leaves the result at its start.
    plan.send = MPI_IN_PLACE;
    plan.recv = const_cast<void*>(op.send_buf);
    plan.move_from = op.send_buf;
    plan.move_to = op.recv_buf;
    plan.move_bytes = offset == 0 ? 0 : mine * beta;
  }
}

void MpiCommunicator::prepare(const CommOp& op, Plan& plan) const {
  plan.type = mpi_type(op.dtype);
  const size_t beta = dtype_size(op.dtype);
  if (op.kind == CommOpKind::kAllGatherV || op.kind == CommOpKind::kReduceScatterV) {
    plan.counts.resize(size());
    plan.displs.resize(size());
    int offset = 0;
    for (int r = 0; r < size(); ++r) {
      plan.counts[r] = static_cast<int>(op.counts[r]);
      plan.displs[r] = offset;
      offset += plan.counts[r];
    }
  }
  if (is_reduction(op.kind)) return prepare_reduction(op, plan);
  plan.send = op.send_buf;
  plan.recv = op.recv_buf;
  if (op.kind == CommOpKind::kAllGather || op.kind == CommOpKind::kAllGatherV) {
    const uint64_t offset = op.kind == CommOpKind::kAllGather ? op.count * rank() : plan.displs[rank()];
    if (op.send_buf == static_cast<const char*>(op.recv_buf) + offset * beta) plan.send = MPI_IN_PLACE;
  }
  if (op.kind == CommOpKind::kRecv) plan.recv_status = 0;
  if (op.kind == CommOpKind::kSendRecv) {
    plan.n_requests = 2;
    plan.recv_status = 1;
  }
}

// One MPI call per kind, blocking or not. Counts fit in int (supports()).
void MpiCommunicator::post(const CommOp& op, Plan& p, bool blocking) {
  const int n = static_cast<int>(op.count);
  const bool scatter = op.kind == CommOpKind::kReduceScatter || op.kind == CommOpKind::kReduceScatterV;
  if (scatter && ctx_->pairwise_reduce_scatter && size() > 1) {
    post_pairwise_reduce_scatter(op, p);
    if (blocking) FP_MPI_CHECK(MPI_Waitall(p.n_requests, p.requests.data(), p.statuses.data()));
    return;
  }
  const bool large = op.count * dtype_size(op.dtype) >= kPairwiseAllReduceBytes;
  if (op.kind == CommOpKind::kAllReduce && blocking && ctx_->pairwise_reduce_scatter && size() > 1 && large) {
    all_reduce_pairwise(op, p);
    return;
  }
  if (!blocking && ctx_->pairwise_reduce_scatter && large && op.kind == CommOpKind::kReduce && size() > 1) {
    post_reduce_to_root(op, p);
    return;
  }
  MPI_Request* rq = p.requests.data();
  switch (op.kind) {
    case CommOpKind::kBroadcast:
      if (blocking) FP_MPI_CHECK(MPI_Bcast(p.recv, n, p.type, op.root, comm_));
      else FP_MPI_CHECK(MPI_Ibcast(p.recv, n, p.type, op.root, comm_, rq));
      return;
    case CommOpKind::kReduce:
      if (blocking) FP_MPI_CHECK(MPI_Reduce(p.send, p.recv, n, p.type, mpi_op(op.reduce_op), op.root, comm_));
      else FP_MPI_CHECK(MPI_Ireduce(p.send, p.recv, n, p.type, mpi_op(op.reduce_op), op.root, comm_, rq));
      return;
    case CommOpKind::kAllReduce:
      if (blocking) FP_MPI_CHECK(MPI_Allreduce(p.send, p.recv, n, p.type, mpi_op(op.reduce_op), comm_));
      else FP_MPI_CHECK(MPI_Iallreduce(p.send, p.recv, n, p.type, mpi_op(op.reduce_op), comm_, rq));
      return;
    case CommOpKind::kAllGather:
      if (blocking) FP_MPI_CHECK(MPI_Allgather(p.send, n, p.type, p.recv, n, p.type, comm_));
      else FP_MPI_CHECK(MPI_Iallgather(p.send, n, p.type, p.recv, n, p.type, comm_, rq));
      return;
    case CommOpKind::kAllGatherV: {
      const int mine = p.counts[rank()];
      if (blocking) {
        FP_MPI_CHECK(MPI_Allgatherv(p.send, mine, p.type, p.recv, p.counts.data(), p.displs.data(), p.type, comm_));
      } else {
        FP_MPI_CHECK(
            MPI_Iallgatherv(p.send, mine, p.type, p.recv, p.counts.data(), p.displs.data(), p.type, comm_, rq));
      }
      return;
    }
    case CommOpKind::kReduceScatter:
      if (blocking) FP_MPI_CHECK(MPI_Reduce_scatter_block(p.send, p.recv, n, p.type, mpi_op(op.reduce_op), comm_));
      else FP_MPI_CHECK(MPI_Ireduce_scatter_block(p.send, p.recv, n, p.type, mpi_op(op.reduce_op), comm_, rq));
      return;
    case CommOpKind::kReduceScatterV:
      if (blocking) {
        FP_MPI_CHECK(MPI_Reduce_scatter(p.send, p.recv, p.counts.data(), p.type, mpi_op(op.reduce_op), comm_));
      } else {
        FP_MPI_CHECK(MPI_Ireduce_scatter(p.send, p.recv, p.counts.data(), p.type, mpi_op(op.reduce_op), comm_, rq));
      }
      return;
    case CommOpKind::kAllToAll:
      if (blocking) FP_MPI_CHECK(MPI_Alltoall(p.send, n, p.type, p.recv, n, p.type, comm_));
      else FP_MPI_CHECK(MPI_Ialltoall(p.send, n, p.type, p.recv, n, p.type, comm_, rq));
      return;
    case CommOpKind::kSend:
      if (blocking) FP_MPI_CHECK(MPI_Send(p.send, n, p.type, op.peer, kPointToPointTag + op.tag, comm_));
      else FP_MPI_CHECK(MPI_Isend(p.send, n, p.type, op.peer, kPointToPointTag + op.tag, comm_, rq));
      return;
    case CommOpKind::kRecv:
      if (blocking) FP_MPI_CHECK(MPI_Recv(p.recv, n, p.type, op.source, kPointToPointTag + op.tag, comm_, &p.statuses[0]));
      else FP_MPI_CHECK(MPI_Irecv(p.recv, n, p.type, op.source, kPointToPointTag + op.tag, comm_, rq));
      return;
    case CommOpKind::kSendRecv:
      if (blocking) {
        FP_MPI_CHECK(MPI_Sendrecv(p.send, n, p.type, op.peer, kPointToPointTag, p.recv, n, p.type, op.source,
                                  kPointToPointTag, comm_, &p.statuses[1]));
      } else {
        FP_MPI_CHECK(MPI_Irecv(p.recv, n, p.type, op.source, kPointToPointTag, comm_, &rq[1]));
        FP_MPI_CHECK(MPI_Isend(p.send, n, p.type, op.peer, kPointToPointTag, comm_, &rq[0]));
      }
      return;
    case CommOpKind::kBarrier:
      if (blocking) FP_MPI_CHECK(MPI_Barrier(comm_));
      else FP_MPI_CHECK(MPI_Ibarrier(comm_, rq));
      return;
  }
}

// After prepare(): the reduction's input is op.send_buf, or for bf16 its f32 copy in
// plan.stage (prepare_reduction). Block j of the input goes to rank j; this rank receives
// its block's N-1 contributions into plan.incoming, and finish() reduces them.
void MpiCommunicator::post_pairwise_reduce_scatter(const CommOp& op, Plan& p) {
  const bool bf16 = op.dtype == DType::kBF16;
  const bool v = op.kind == CommOpKind::kReduceScatterV;
  std::vector<size_t> counts(size()), offsets(size());
  for (int j = 0; j < size(); ++j) {
    counts[j] = v ? static_cast<size_t>(p.counts[j]) : static_cast<size_t>(op.count);
    offsets[j] = v ? static_cast<size_t>(p.displs[j]) : op.count * static_cast<size_t>(j);
  }
  const void* input = bf16 ? static_cast<const void*>(p.stage()) : op.send_buf;
  void* own_out = bf16 ? static_cast<void*>(p.stage() + offsets[rank()]) : op.recv_buf;
  if (bf16) p.bf16_from = p.stage() + offsets[rank()];
  post_pairwise(op, p, input, counts, offsets, own_out);
}

// Posts the exchange: to each rank j its block [offsets[j], + counts[j]) of `input`, and
// from every other rank its contribution to this rank's block, into plan.incoming.
void MpiCommunicator::post_pairwise(const CommOp& op, Plan& p, const void* input, const std::vector<size_t>& counts,
                                    const std::vector<size_t>& offsets, void* own_out) {
  const int N = size(), r = rank();
  p.reduce_dtype = op.dtype == DType::kBF16 ? DType::kF32 : op.dtype;
  const size_t w = dtype_size(p.reduce_dtype);
  const auto* in = static_cast<const std::byte*>(input);
  p.pairwise = true;
  p.own_count = counts[r];
  p.own_in = in + offsets[r] * w;
  p.own_out = own_out;
  p.move_bytes = 0;  // the result is written where it belongs
  p.recv_status = -1;
  p.incoming = ScratchBuffer::take(static_cast<size_t>(N - 1) * p.own_count * w);
  p.n_requests = 2 * (N - 1);
  p.requests.assign(p.n_requests, MPI_REQUEST_NULL);
  p.statuses.resize(p.n_requests);
  constexpr int kTag = 1;
  for (int k = 1; k < N; ++k) {
    const int from = (r - k + N) % N;
    FP_MPI_CHECK(MPI_Irecv(p.incoming.data() + static_cast<size_t>(k - 1) * p.own_count * w,
                           static_cast<int>(p.own_count), p.type, from, kTag, pairwise_comm_, &p.requests[2 * (k - 1)]));
  }
  for (int k = 1; k < N; ++k) {
    const int to = (r + k) % N;
    FP_MPI_CHECK(MPI_Isend(in + offsets[to] * w, static_cast<int>(counts[to]), p.type, to, kTag, pairwise_comm_,
                           &p.requests[2 * (k - 1) + 1]));
  }
}

// A non-blocking reduce as whole buffers sent to the root: Open MPI 4.1's MPI_Ireduce runs
// 3-6x slower here than this at 1-64 MiB on two ranks (and 5-20x slower than its own
// blocking reduce; docs/PERFORMANCE.md, "Non-blocking reduce"). Every other rank posts its
// whole input to the root, which receives them in rank-distance order and reduces them on
// completion (finish), in that order. One phase, so requests completed in any order on any
// rank cannot deadlock (unlike a two-phase all-reduce). The root receives N-1 buffers (a
// tree would bring it log2 N); the library's non-blocking all-reduce is kept, as fast as a
// plain exchange of two ranks' buffers at 4-64 MiB here.
void MpiCommunicator::post_reduce_to_root(const CommOp& op, Plan& p) {
  const int N = size(), r = rank();
  const bool bf16 = op.dtype == DType::kBF16;
  p.reduce_dtype = bf16 ? DType::kF32 : op.dtype;
  const size_t w = dtype_size(p.reduce_dtype), n = op.count;
  const void* input = bf16 ? static_cast<const void*>(p.stage()) : op.send_buf;
  p.move_bytes = 0;
  p.recv_status = -1;
  p.requests.clear();
  p.requests.reserve(static_cast<size_t>(N));
  constexpr int kTag = 1;
  if (r == op.root) {
    p.pairwise = true;
    p.own_count = n;
    p.own_in = input;
    p.own_out = bf16 ? static_cast<void*>(p.stage()) : op.recv_buf;
    p.incoming = ScratchBuffer::take(static_cast<size_t>(N - 1) * n * w);
    for (int k = 1; k < N; ++k) {
      p.requests.push_back(MPI_REQUEST_NULL);
      FP_MPI_CHECK(MPI_Irecv(p.incoming.data() + static_cast<size_t>(k - 1) * n * w, static_cast<int>(n), p.type,
                             (r - k + N) % N, kTag, pairwise_comm_, &p.requests.back()));
    }
  } else {
    p.requests.push_back(MPI_REQUEST_NULL);
    FP_MPI_CHECK(MPI_Isend(input, static_cast<int>(n), p.type, op.root, kTag, pairwise_comm_, &p.requests.back()));
  }
  p.n_requests = static_cast<int>(p.requests.size());
  p.statuses.resize(p.requests.size());
}

// A blocking all-reduce as a pairwise reduce-scatter of N near-equal blocks, the reduction,
// then the library's all-gather in place: Debian's OpenMPI 4.1.4 all-reduces 64 MiB in
// 0.2-0.3 s here, faulting in fresh temporary pages on every call (its non-blocking
// all-reduce does not: 17 ms); this path takes 11-20 ms (docs/PERFORMANCE.md, "Fresh pages").
// Only the blocking form: a non-blocking one would need its all-gather started once the
// reduction is done, on every rank, whatever request that rank is waiting for (a progress
// engine), or ranks completing two of them in different orders deadlock.
void MpiCommunicator::all_reduce_pairwise(const CommOp& op, Plan& p) {
  const int N = size();
  const bool bf16 = op.dtype == DType::kBF16;
  std::vector<size_t> counts(N), offsets(N);
  size_t offset = 0;
  for (int j = 0; j < N; ++j) {
    counts[j] = op.count / N + (static_cast<size_t>(j) < op.count % N ? 1 : 0);
    offsets[j] = offset;
    offset += counts[j];
  }
  const void* input = bf16 ? static_cast<const void*>(p.stage()) : op.send_buf;
  std::byte* output = static_cast<std::byte*>(bf16 ? static_cast<void*>(p.stage()) : op.recv_buf);
  const size_t w = dtype_size(bf16 ? DType::kF32 : op.dtype);
  post_pairwise(op, p, input, counts, offsets, output + offsets[rank()] * w);
  FP_MPI_CHECK(MPI_Waitall(p.n_requests, p.requests.data(), p.statuses.data()));
  reduce_pairwise(op, p);
  std::vector<int> icounts(N), idispls(N);
  for (int j = 0; j < N; ++j) {
    icounts[j] = static_cast<int>(counts[j]);
    idispls[j] = static_cast<int>(offsets[j]);
  }
  FP_MPI_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, p.type, output, icounts.data(), idispls.data(), p.type, comm_));
  p.n_requests = 0;
}

void MpiCommunicator::reduce_pairwise(const CommOp& op, Plan& plan) const {
  const int k = size() - 1;
  const size_t n = plan.own_count;
  auto reduce = [&](auto* out) {
    using T = std::remove_pointer_t<decltype(out)>;
    reduce_into(op.reduce_op, static_cast<const T*>(plan.own_in), plan.incoming.data(), k, n, out);
  };
  switch (plan.reduce_dtype) {
    case DType::kF32: reduce(static_cast<float*>(plan.own_out)); break;
    case DType::kF64: reduce(static_cast<double*>(plan.own_out)); break;
    case DType::kI32: reduce(static_cast<int32_t*>(plan.own_out)); break;
    case DType::kI64: reduce(static_cast<int64_t*>(plan.own_out)); break;
    case DType::kBF16: FP_CHECK(false, "pairwise reductions reduce bf16 as f32"); break;
  }
  plan.pairwise = false;  // done
}

void MpiCommunicator::finish(const CommOp& op, Plan& plan) const {
  if (plan.pairwise) reduce_pairwise(op, plan);
  if (plan.recv_status >= 0) {
    int received = 0;
    FP_MPI_CHECK(MPI_Get_count(&plan.statuses[plan.recv_status], plan.type, &received));
    FP_CHECK(received == static_cast<int>(op.count), "{} #{} on communicator {}: expected {} elements from rank {}, "
             "received {}", comm_op_name(op.kind), op.seq, describe(), op.count, op.source, received);
  }
  if (plan.bf16_out != nullptr)
    narrow_to_bf16(plan.bf16_from != nullptr ? plan.bf16_from : plan.stage(), plan.bf16_count, plan.bf16_out);
  if (plan.move_bytes > 0) std::memmove(plan.move_to, plan.move_from, plan.move_bytes);
}

void MpiCommunicator::check_collective(const CommOp& op) {
  const CollectiveDescriptor mine = describe_collective(op);
  std::vector<CollectiveDescriptor> all(size());
  FP_MPI_CHECK(MPI_Allgather(&mine, sizeof mine, MPI_BYTE, all.data(), sizeof mine, MPI_BYTE, check_comm_));
  const std::string disagreement = find_disagreement(all, world_ranks(), describe());
  if (!disagreement.empty()) fatal_error(__FILE__, __LINE__, "checking mode: " + disagreement);
}

Status MpiCommunicator::run_validated(const CommOp& op) {
  WatchdogScope watch(ctx_->watchdog.get(), *this, key_, op);
  if (is_collective(op.kind) && ctx_->check.load(std::memory_order_relaxed)) check_collective(op);
  Plan plan;
  prepare(op, plan);
  post(op, plan, /*blocking=*/true);
  finish(op, plan);
  return Status::ok_status();
}

CommRequest MpiCommunicator::start_validated(const CommOp& op) {
  MpiWatchdog* watchdog = ctx_->watchdog.get();
  const uint64_t token = watchdog != nullptr ? watchdog->begin(*this, key_, op, /*waiting=*/false) : 0;
  if (is_collective(op.kind) && ctx_->check.load(std::memory_order_relaxed)) check_collective(op);
  auto plan = std::make_unique<Plan>();
  prepare(op, *plan);
  post(op, *plan, /*blocking=*/false);
  return CommRequest(std::make_unique<MpiRequest>(*this, op, std::move(plan), watchdog, token));
}

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MpiContext* ctx, MPI_Comm comm, std::string name) {
  int rank = 0, size = 0;
  FP_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  FP_MPI_CHECK(MPI_Comm_size(comm, &size));
  MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
  FP_MPI_CHECK(MPI_Comm_group(comm, &group));
  FP_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
  std::vector<int> ranks(size), world_ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  FP_MPI_CHECK(MPI_Group_translate_ranks(group, size, ranks.data(), world_group, world_ranks.data()));
  FP_MPI_CHECK(MPI_Group_free(&group));
  FP_MPI_CHECK(MPI_Group_free(&world_group));
  return std::make_unique<MpiCommunicator>(ctx, comm, std::move(name), std::move(world_ranks), rank, size);
}

}  // namespace foldpar::mpi_detail
