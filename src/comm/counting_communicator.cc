// CountingCommunicator: operations that complete at once and are recorded; the counting mesh.
#include "comm/counting_communicator.h"

#include <algorithm>

#include <numeric>

#include "core/check.h"

namespace foldpar {
namespace {

// A non-blocking operation of a counting communicator: already done; its completion is
// recorded when the program waits for it or sees it done.
class CountingRequest final : public CommRequestImpl {
 public:
  CountingRequest(uint64_t request, EventOrder& order, CommTrace& trace, const CommEvent& start)
      : request_(request), order_(order), trace_(trace), start_(start) {}
  Status wait() override {
    complete();
    return Status();
  }
  // A point-to-point transfer is never done on a test, only on its wait: a test is the
  // pipeline boundary's progress poke, and recording it as a completion would make the
  // coupled timeline (plan/timeline.h) wait there for a peer that posts later (interleaved
  // 1F1B, where a rank sends what its neighbour takes only ops later).
  Status test(bool* done) override {
    if (start_.kind == CommOpKind::kSend || start_.kind == CommOpKind::kRecv) {
      *done = false;
      return Status();
    }
    complete();
    *done = true;
    return Status();
  }

 private:
  void complete() {
    CommEvent e = start_;
    e.type = CommEvent::Type::kComplete;
    e.seq = order_.next();
    e.request = request_;
    trace_.events.push_back(std::move(e));
  }
  uint64_t request_;
  EventOrder& order_;
  CommTrace& trace_;
  CommEvent start_;
};

}  // namespace

CountingCommunicator::CountingCommunicator(int rank, int size, std::string name, std::vector<int> world_ranks,
                                           EventOrder& order, CommTrace& trace)
    : Communicator(rank, size, std::move(name), std::move(world_ranks)),
      order_(order),
      trace_(trace),
      index_(static_cast<int>(trace.comms.size())) {
  trace_.comms.push_back({this->name(), this->rank(), this->size(), this->world_ranks()});
}

std::unique_ptr<Communicator> CountingCommunicator::split(int /*color*/, int /*key*/, std::string name) {
  FP_CHECK(false, "split of counting communicator {} into {}: a dry run builds its mesh with make_counting_mesh",
           describe(), name);
  return nullptr;
}

std::unique_ptr<Communicator> CountingCommunicator::group(const std::vector<int>& group, std::string name) {
  const int me = world_ranks()[static_cast<size_t>(rank())];
  const auto at = std::find(group.begin(), group.end(), me);
  FP_CHECK(at != group.end(), "group {} of {}: world rank {} is not a member", name, describe(), me);
  return std::make_unique<CountingCommunicator>(static_cast<int>(at - group.begin()), static_cast<int>(group.size()),
                                                std::move(name), group, order_, trace_);
}

Status CountingCommunicator::supports(const CommOp& op) const {
  if (op.stream.native != nullptr) return unimplemented("a counting communicator takes no stream");
  return Status();
}

uint64_t CountingCommunicator::record_start(const CommOp& op, bool blocking) {
  if (trace_.on_exchange && (op.kind == CommOpKind::kAllGather || op.kind == CommOpKind::kAllToAll))
    trace_.on_exchange(op, rank(), size());
  CommEvent e;
  e.type = CommEvent::Type::kStart;
  e.seq = order_.next();
  e.request = ++trace_.operations;
  e.kind = op.kind;
  e.blocking = blocking;
  e.comm = index_;
  e.count = op.counts.empty() ? op.count : std::accumulate(op.counts.begin(), op.counts.end(), uint64_t{0});
  e.dtype = op.dtype;
  const OpTraffic t = ring_traffic(op, rank(), size());
  e.bytes_sent = t.bytes_sent;
  e.bytes_received = t.bytes_received;
  if (op.kind == CommOpKind::kBroadcast || op.kind == CommOpKind::kReduce) e.root = op.root;
  if (op.kind == CommOpKind::kSend || op.kind == CommOpKind::kSendRecv) e.peer = op.peer;
  if (op.kind == CommOpKind::kRecv || op.kind == CommOpKind::kSendRecv) e.source = op.source;
  e.tag = op.tag;
  trace_.events.push_back(std::move(e));
  return trace_.operations;
}

Status CountingCommunicator::run_validated(const CommOp& op) {
  record_start(op, /*blocking=*/true);
  return Status();
}

CommRequest CountingCommunicator::start_validated(const CommOp& op) {
  const uint64_t id = record_start(op, /*blocking=*/false);
  return CommRequest(std::make_unique<CountingRequest>(id, order_, trace_, trace_.events.back()));
}

Result<CountingMesh> make_counting_mesh(const MeshLayout& layout, int world_rank, EventOrder& order,
                                        CommTrace& trace) {
  FP_RETURN_IF_ERROR(MeshLayout::parse(layout.to_string()).status());
  const int n = layout.num_ranks();
  if (world_rank < 0 || world_rank >= n) {
    return invalid_argument("world rank {} is not a rank of layout {} ({} ranks)", world_rank, layout.to_string(), n);
  }
  std::vector<int> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  CountingMesh out;
  out.world = std::make_unique<CountingCommunicator>(world_rank, n, "world", std::move(all), order, trace);
  const std::vector<int> coords = Mesh::coords_of(layout, world_rank);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (size_t i = 0; i < layout.axes.size(); ++i) {
    comms.push_back(std::make_unique<CountingCommunicator>(coords[i], layout.axes[i].degree, layout.axes[i].name,
                                                           Mesh::axis_world_ranks(layout, coords, static_cast<int>(i)),
                                                           order, trace));
  }
  FP_ASSIGN_OR_RETURN(Mesh mesh, Mesh::from_communicators(*out.world, layout, std::move(comms)));
  out.mesh = std::make_unique<Mesh>(std::move(mesh));
  return out;
}

}  // namespace foldpar
