// The backend-independent half of Communicator: the entry points, the one validated path
// they share (contract checks, sequence numbers, traffic counters), and CommRequest.
#include "comm/communicator.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <numeric>

#include "core/check.h"

namespace foldpar {

// ---- CommRequest ----

CommRequest::CommRequest(std::unique_ptr<CommRequestImpl> impl) : impl_(std::move(impl)) {}

CommRequest CommRequest::failed(Status status) {
  CommRequest request;
  request.status_ = std::move(status);
  return request;
}

CommRequest::CommRequest(CommRequest&& other) noexcept
    : impl_(std::move(other.impl_)), status_(std::move(other.status_)) {}

CommRequest& CommRequest::operator=(CommRequest&& other) noexcept {
  FP_CHECK(impl_ == nullptr, "a pending CommRequest was overwritten before wait()");
  impl_ = std::move(other.impl_);
  status_ = std::move(other.status_);
  return *this;
}

CommRequest::~CommRequest() {
  FP_CHECK(impl_ == nullptr, "a CommRequest was destroyed while its operation was in flight; call wait()");
}

Status CommRequest::wait() {
  if (impl_ != nullptr) {
    status_ = impl_->wait();
    impl_.reset();
  }
  return status_;
}

Status CommRequest::test(bool* done) {
  FP_CHECK(done != nullptr);
  if (impl_ != nullptr) {
    Status status = impl_->test(done);
    if (!*done) return status;
    status_ = std::move(status);
    impl_.reset();
  }
  *done = true;
  return status_;
}

// ---- Communicator ----

Communicator::Communicator(int rank, int size, std::string name, std::vector<int> world_ranks)
    : rank_(rank), size_(size), name_(std::move(name)), world_ranks_(std::move(world_ranks)) {
  FP_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "rank {} of {}", rank_, size_);
  FP_CHECK(static_cast<int>(world_ranks_.size()) == size_, "{} world ranks for {} ranks", world_ranks_.size(),
           size_);
}

std::string Communicator::describe() const {
  // Consecutive runs as "a-b": "tsp (world ranks 0-3)", "tp (world ranks 0,2)".
  std::string ranks;
  for (size_t i = 0; i < world_ranks_.size();) {
    size_t j = i;
    while (j + 1 < world_ranks_.size() && world_ranks_[j + 1] == world_ranks_[j] + 1) ++j;
    if (!ranks.empty()) ranks += ",";
    ranks += j > i + 1 ? fmt::format("{}-{}", world_ranks_[i], world_ranks_[j]) : fmt::format("{}", world_ranks_[i]);
    if (j == i + 1) ranks += fmt::format(",{}", world_ranks_[j]);
    i = j + 1;
  }
  return fmt::format("{} (world rank{} {})", name_, size_ == 1 ? "" : "s", ranks);
}

namespace {

// "all_gather on communicator tsp": the prefix of every contract message, built only when
// a check fails.
struct OpSite {
  const CommOp& op;
  const std::string& comm_name;
  std::string str() const { return fmt::format("{} on communicator {}", comm_op_name(op.kind), comm_name); }
};

struct ByteRange {
  uintptr_t begin = 0;
  uintptr_t end = 0;
};
ByteRange range_of(const void* p, uint64_t elements, DType dtype) {
  const auto begin = reinterpret_cast<uintptr_t>(p);
  return {begin, begin + elements * dtype_size(dtype)};
}
bool overlap(ByteRange a, ByteRange b) {
  return a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end;
}
const void* offset(const void* base, uint64_t elements, DType dtype) {
  return static_cast<const char*>(base) + elements * dtype_size(dtype);
}
uint64_t prefix(std::span<const size_t> counts, int r) {
  return std::accumulate(counts.begin(), counts.begin() + r, uint64_t{0});
}

// The send range [send_elems] and receive range [recv_elems] may meet only in the in-place
// form, which `in_place` says this call is.
void check_disjoint(const OpSite& site, uint64_t send_elems, uint64_t recv_elems, bool in_place) {
  const CommOp& op = site.op;
  if (in_place) return;
  FP_CHECK(!overlap(range_of(op.send_buf, send_elems, op.dtype), range_of(op.recv_buf, recv_elems, op.dtype)),
           "{}: send_buf and recv_buf overlap but are not the in-place form", site.str());
}

void check_not_null(const OpSite& site, const void* buf, uint64_t elements, const char* which) {
  FP_CHECK(elements == 0 || buf != nullptr, "{}: {} is null for {} elements", site.str(), which, elements);
}

// Buffers this rank uses: non-null where their count is not zero, disjoint except in place.
void check_buffers(const OpSite& site, int rank, int size) {
  const CommOp& op = site.op;
  const uint64_t n = op.count;
  switch (op.kind) {
    case CommOpKind::kBroadcast: check_not_null(site, op.recv_buf, n, "buf"); return;
    case CommOpKind::kReduce:
    case CommOpKind::kAllReduce: {
      check_not_null(site, op.send_buf, n, "send_buf");
      if (op.kind == CommOpKind::kReduce && rank != op.root) return;  // recv_buf unused
      check_not_null(site, op.recv_buf, n, "recv_buf");
      check_disjoint(site, n, n, op.send_buf == op.recv_buf);
      return;
    }
    case CommOpKind::kAllGather:
      check_not_null(site, op.send_buf, n, "send_buf");
      check_not_null(site, op.recv_buf, n * size, "recv_buf");
      check_disjoint(site, n, n * size, op.send_buf == offset(op.recv_buf, n * rank, op.dtype));
      return;
    case CommOpKind::kReduceScatter:
      check_not_null(site, op.send_buf, n * size, "send_buf");
      check_not_null(site, op.recv_buf, n, "recv_buf");
      check_disjoint(site, n * size, n, op.recv_buf == offset(op.send_buf, n * rank, op.dtype));
      return;
    case CommOpKind::kAllGatherV:
    case CommOpKind::kReduceScatterV: {
      const uint64_t total = prefix(op.counts, size), mine = op.counts[rank], off = prefix(op.counts, rank);
      const bool gather = op.kind == CommOpKind::kAllGatherV;
      check_not_null(site, op.send_buf, gather ? mine : total, "send_buf");
      check_not_null(site, op.recv_buf, gather ? total : mine, "recv_buf");
      if (gather) {
        check_disjoint(site, mine, total, op.send_buf == offset(op.recv_buf, off, op.dtype));
      } else {
        check_disjoint(site, total, mine, op.recv_buf == offset(op.send_buf, off, op.dtype));
      }
      return;
    }
    case CommOpKind::kAllToAll:
      check_not_null(site, op.send_buf, n * size, "send_buf");
      check_not_null(site, op.recv_buf, n * size, "recv_buf");
      check_disjoint(site, n * size, n * size, false);
      return;
    case CommOpKind::kSend: check_not_null(site, op.send_buf, n, "buf"); return;
    case CommOpKind::kRecv: check_not_null(site, op.recv_buf, n, "buf"); return;
    case CommOpKind::kSendRecv:
      check_not_null(site, op.send_buf, n, "send_buf");
      check_not_null(site, op.recv_buf, n, "recv_buf");
      check_disjoint(site, n, n, false);
      return;
    case CommOpKind::kBarrier: return;
  }
}

}  // namespace

Status Communicator::submit(CommOp& op) {
  const OpSite site{op, name_};
  const auto in_range = [&](int r) { return r >= 0 && r < size_; };
  if (op.kind == CommOpKind::kBroadcast || op.kind == CommOpKind::kReduce) {
    FP_CHECK(in_range(op.root), "{}: root {} is not a rank of {} ranks", site.str(), op.root, size_);
  }
  if (op.kind == CommOpKind::kSend || op.kind == CommOpKind::kSendRecv) {
    FP_CHECK(in_range(op.peer), "{}: peer {} is not a rank of {} ranks", site.str(), op.peer, size_);
  }
  if (op.kind == CommOpKind::kRecv || op.kind == CommOpKind::kSendRecv) {
    FP_CHECK(in_range(op.source), "{}: source {} is not a rank of {} ranks", site.str(), op.source, size_);
  }
  FP_CHECK(op.tag >= 0 && op.tag <= 32767 && (op.tag == 0 || op.kind == CommOpKind::kSend || op.kind == CommOpKind::kRecv),
           "{}: tag {} (0..32767, send and recv only)", site.str(), op.tag);
  if (op.kind == CommOpKind::kAllGatherV || op.kind == CommOpKind::kReduceScatterV) {
    FP_CHECK(static_cast<int>(op.counts.size()) == size_, "{}: counts has {} entries for {} ranks", site.str(),
             op.counts.size(), size_);
  }
  check_buffers(site, rank_, size_);
  if (Status status = supports(op); !status.ok()) return status.with_context(site.str());
  if (is_collective(op.kind)) {
    op.seq = collective_seq_.load(std::memory_order_relaxed) + 1;
    collective_seq_.store(op.seq, std::memory_order_relaxed);
  } else {
    op.seq = ++p2p_seq_;
  }
  stats_.record(op.kind, ring_traffic(op, rank_, size_));
  return Status::ok_status();
}

namespace {

// A request whose wait() adds its blocked time to its communicator's count of the kind.
class TimedRequest final : public CommRequestImpl {
 public:
  TimedRequest(CommRequest inner, double* blocked_s) : inner_(std::move(inner)), blocked_s_(blocked_s) {}
  Status wait() override {
    const auto t0 = std::chrono::steady_clock::now();
    Status status = inner_.wait();
    *blocked_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return status;
  }
  Status test(bool* done) override { return inner_.test(done); }

 private:
  CommRequest inner_;
  double* blocked_s_;
};

CommRequest timed(CommRequest request, double* blocked_s) {
  if (!request.pending()) return request;
  return CommRequest(std::make_unique<TimedRequest>(std::move(request), blocked_s));
}

}  // namespace

Status Communicator::run(CommOp op) {
  FP_RETURN_IF_ERROR(submit(op));
  const auto t0 = std::chrono::steady_clock::now();
  Status status = run_validated(op);
  blocked_s_[static_cast<int>(op.kind)] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return status;
}

CommRequest Communicator::start(CommOp op) {
  Status status = submit(op);
  if (!status.ok()) return CommRequest::failed(std::move(status));
  return timed(start_validated(op), &blocked_s_[static_cast<int>(op.kind)]);
}

std::vector<CommRequest> Communicator::start_group(std::span<const CommOp> ops) {
  std::vector<CommOp> submitted(ops.begin(), ops.end());
  Status refused;
  size_t n = 0;
  for (; n < submitted.size(); ++n) {
    refused = submit(submitted[n]);
    if (!refused.ok()) break;
  }
  std::vector<CommRequest> requests;
  if (n > 0) requests = start_validated_group(std::span<const CommOp>(submitted.data(), n));
  FP_CHECK(requests.size() == n, "{}: a group of {} operations gave {} requests", describe(), n, requests.size());
  for (size_t i = 0; i < n; ++i)
    requests[i] = timed(std::move(requests[i]), &blocked_s_[static_cast<int>(submitted[i].kind)]);
  while (requests.size() < submitted.size()) requests.push_back(CommRequest::failed(refused));
  return requests;
}

std::vector<CommRequest> Communicator::start_validated_group(std::span<const CommOp> ops) {
  std::vector<CommRequest> requests;
  requests.reserve(ops.size());
  for (const CommOp& op : ops) requests.push_back(start_validated(op));
  return requests;
}

// ---- entry points: each fills in a CommOp and takes run() or start() ----

namespace {
CommOp make_op(CommOpKind kind, const void* send_buf, void* recv_buf, size_t count, DType dtype, CommStream stream) {
  CommOp op;
  op.kind = kind;
  op.send_buf = send_buf;
  op.recv_buf = recv_buf;
  op.count = count;
  op.dtype = dtype;
  op.stream = stream;
  return op;
}
CommOp broadcast_op(void* buf, size_t count, DType dtype, int root, CommStream stream) {
  CommOp op = make_op(CommOpKind::kBroadcast, buf, buf, count, dtype, stream);
  op.root = root;
  return op;
}
CommOp reduction_op(CommOpKind kind, const void* send_buf, void* recv_buf, size_t count, DType dtype,
                    ReduceOp reduce_op, CommStream stream) {
  CommOp op = make_op(kind, send_buf, recv_buf, count, dtype, stream);
  op.reduce_op = reduce_op;
  return op;
}
CommOp rooted(CommOp op, int root) {
  op.root = root;
  return op;
}
CommOp with_counts(CommOp op, std::span<const size_t> counts) {
  op.counts = counts;
  return op;
}
CommOp point_to_point(CommOp op, int peer, int source) {
  op.peer = peer;
  op.source = source;
  return op;
}
}  // namespace

Status Communicator::broadcast(void* buf, size_t count, DType dtype, int root, CommStream stream) {
  return run(broadcast_op(buf, count, dtype, root, stream));
}
Status Communicator::reduce(const void* send_buf, void* recv_buf, size_t count, DType dtype, ReduceOp op, int root,
                            CommStream stream) {
  return run(rooted(reduction_op(CommOpKind::kReduce, send_buf, recv_buf, count, dtype, op, stream), root));
}
Status Communicator::all_reduce(const void* send_buf, void* recv_buf, size_t count, DType dtype, ReduceOp op,
                                CommStream stream) {
  return run(reduction_op(CommOpKind::kAllReduce, send_buf, recv_buf, count, dtype, op, stream));
}
Status Communicator::all_gather(const void* send_buf, void* recv_buf, size_t count, DType dtype, CommStream stream) {
  return run(make_op(CommOpKind::kAllGather, send_buf, recv_buf, count, dtype, stream));
}
Status Communicator::all_gather_v(const void* send_buf, void* recv_buf, std::span<const size_t> counts, DType dtype,
                                  CommStream stream) {
  return run(with_counts(make_op(CommOpKind::kAllGatherV, send_buf, recv_buf, 0, dtype, stream), counts));
}
Status Communicator::reduce_scatter(const void* send_buf, void* recv_buf, size_t count, DType dtype, ReduceOp op,
                                    CommStream stream) {
  return run(reduction_op(CommOpKind::kReduceScatter, send_buf, recv_buf, count, dtype, op, stream));
}
Status Communicator::reduce_scatter_v(const void* send_buf, void* recv_buf, std::span<const size_t> counts,
                                      DType dtype, ReduceOp op, CommStream stream) {
  return run(with_counts(reduction_op(CommOpKind::kReduceScatterV, send_buf, recv_buf, 0, dtype, op, stream), counts));
}
Status Communicator::all_to_all(const void* send_buf, void* recv_buf, size_t count, DType dtype, CommStream stream) {
  return run(make_op(CommOpKind::kAllToAll, send_buf, recv_buf, count, dtype, stream));
}
Status Communicator::barrier(CommStream stream) {
  return run(make_op(CommOpKind::kBarrier, nullptr, nullptr, 0, DType::kF32, stream));
}
Status Communicator::send(const void* buf, size_t count, DType dtype, int peer, CommStream stream) {
  return run(point_to_point(make_op(CommOpKind::kSend, buf, nullptr, count, dtype, stream), peer, -1));
}
Status Communicator::recv(void* buf, size_t count, DType dtype, int source, CommStream stream) {
  return run(point_to_point(make_op(CommOpKind::kRecv, nullptr, buf, count, dtype, stream), -1, source));
}
Status Communicator::send_recv(const void* send_buf, void* recv_buf, size_t count, DType dtype, int peer, int source,
                               CommStream stream) {
  return run(point_to_point(make_op(CommOpKind::kSendRecv, send_buf, recv_buf, count, dtype, stream), peer, source));
}

CommRequest Communicator::ibroadcast(void* buf, size_t count, DType dtype, int root, CommStream stream) {
  return start(broadcast_op(buf, count, dtype, root, stream));
}
CommRequest Communicator::ireduce(const void* send_buf, void* recv_buf, size_t count, DType dtype, ReduceOp op,
                                  int root, CommStream stream) {
  return start(rooted(reduction_op(CommOpKind::kReduce, send_buf, recv_buf, count, dtype, op, stream), root));
}
CommRequest Communicator::iall_reduce(const void* send_buf, void* recv_buf, size_t count, DType dtype, ReduceOp op,
                                      CommStream stream) {
  return start(reduction_op(CommOpKind::kAllReduce, send_buf, recv_buf, count, dtype, op, stream));
}
CommRequest Communicator::iall_gather(const void* send_buf, void* recv_buf, size_t count, DType dtype,
                                      CommStream stream) {
  return start(make_op(CommOpKind::kAllGather, send_buf, recv_buf, count, dtype, stream));
}
CommRequest Communicator::iall_gather_v(const void* send_buf, void* recv_buf, std::span<const size_t> counts,
                                        DType dtype, CommStream stream) {
  return start(with_counts(make_op(CommOpKind::kAllGatherV, send_buf, recv_buf, 0, dtype, stream), counts));
}
CommRequest Communicator::ireduce_scatter(const void* send_buf, void* recv_buf, size_t count, DType dtype,
                                          ReduceOp op, CommStream stream) {
  return start(reduction_op(CommOpKind::kReduceScatter, send_buf, recv_buf, count, dtype, op, stream));
}
CommRequest Communicator::ireduce_scatter_v(const void* send_buf, void* recv_buf, std::span<const size_t> counts,
                                            DType dtype, ReduceOp op, CommStream stream) {
  return start(
      with_counts(reduction_op(CommOpKind::kReduceScatterV, send_buf, recv_buf, 0, dtype, op, stream), counts));
}
CommRequest Communicator::iall_to_all(const void* send_buf, void* recv_buf, size_t count, DType dtype,
                                      CommStream stream) {
  return start(make_op(CommOpKind::kAllToAll, send_buf, recv_buf, count, dtype, stream));
}
CommRequest Communicator::ibarrier(CommStream stream) {
  return start(make_op(CommOpKind::kBarrier, nullptr, nullptr, 0, DType::kF32, stream));
}
CommRequest Communicator::isend(const void* buf, size_t count, DType dtype, int peer, CommStream stream) {
  return start(point_to_point(make_op(CommOpKind::kSend, buf, nullptr, count, dtype, stream), peer, -1));
}
CommRequest Communicator::irecv(void* buf, size_t count, DType dtype, int source, CommStream stream) {
  return start(point_to_point(make_op(CommOpKind::kRecv, nullptr, buf, count, dtype, stream), -1, source));
}
CommRequest Communicator::isend_recv(const void* send_buf, void* recv_buf, size_t count, DType dtype, int peer,
                                     int source, CommStream stream) {
  return start(
      point_to_point(make_op(CommOpKind::kSendRecv, send_buf, recv_buf, count, dtype, stream), peer, source));
}

}  // namespace foldpar
