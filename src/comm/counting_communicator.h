// CountingCommunicator: the communicator of a dry run (docs/design.md, Planning / dry run).
// It plays one rank of a communicator of any size without any peer: every operation passes
// the base class's checks and counting (Communicator::submit, comm/comm_stats.h: the same
// calls and bytes as a real run) and completes at once without touching a buffer (they are
// normally storage-less). It records every start and every completion in a CommTrace, in the
// program order of an EventOrder shared with the meta backend (backend/meta/meta_backend.h).
//
// make_counting_mesh builds the Mesh that world rank p of a layout of any size sees: one
// counting communicator per axis with the rank, size and world ranks of Mesh's rank order
// (comm/mesh.h), computed, not split; 1024 ranks cost a few vectors.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm_op.h"
#include "comm/comm_stats.h"
#include "comm/communicator.h"
#include "comm/mesh.h"
#include "core/event_order.h"

namespace foldpar {

struct CommEvent {
  enum class Type : uint8_t {
    kStart,     // an operation was submitted (blocking or not)
    kComplete,  // a non-blocking one's wait() or test() reported it done
  };
  Type type = Type::kStart;
  uint64_t seq = 0;         // EventOrder number
  uint64_t request = 0;     // 1-based id of the operation in its trace; kComplete names the start's
  CommOpKind kind = CommOpKind::kBarrier;
  bool blocking = true;
  int comm = 0;             // index in CommTrace::comms
  uint64_t count = 0;       // elements (sum of counts for the _v forms)
  DType dtype = DType::kF32;
  uint64_t bytes_sent = 0, bytes_received = 0;  // ring_traffic
  int root = -1, peer = -1, source = -1;
  int tag = 0;  // send, recv (CommOp::tag)
};

// The events of every counting communicator that shares it. Not thread-safe: one dry run,
// one thread.
struct CommTrace {
  struct Member {  // one communicator that records here
    std::string name;  // "tsp", "dp", "world", ...
    int rank = 0, size = 1;
    std::vector<int> world_ranks;
  };
  std::vector<Member> comms;
  std::vector<CommEvent> events;
  uint64_t operations = 0;  // request ids handed out
  // Called for each all_gather and all_to_all as it is submitted, with the communicator's
  // rank and size: the dry run uses it to know small integer results (the MoE counts and
  // expert ids, MetaBackend::deliver_collective). Null: buffers are never looked at.
  std::function<void(const CommOp& op, int rank, int size)> on_exchange;
};

class CountingCommunicator final : public Communicator {
 public:
  // rank of size; world_ranks[r] the world rank of member r. `order` and `trace` must
  // outlive the communicator.
  CountingCommunicator(int rank, int size, std::string name, std::vector<int> world_ranks, EventOrder& order,
                       CommTrace& trace);

  // Refused: a counting communicator has no peers to agree with (build meshes with
  // make_counting_mesh).
  std::unique_ptr<Communicator> split(int color, int key, std::string name) override;
  // What a split would give this rank without peers to agree with: the communicator of the
  // listed world ranks (this one's among them, ranked in that order), counted like the mesh's
  // (a MoE model's tp x sp expert axis, parallel/make_layout.cc).
  std::unique_ptr<Communicator> group(const std::vector<int>& world_ranks, std::string name);

 protected:
  Status supports(const CommOp& op) const override;
  Status run_validated(const CommOp& op) override;
  CommRequest start_validated(const CommOp& op) override;

 private:
  uint64_t record_start(const CommOp& op, bool blocking);

  EventOrder& order_;
  CommTrace& trace_;
  int index_;  // in trace_.comms
};

// The mesh world rank `world_rank` of `layout` sees, every axis a counting communicator;
// `world` (a counting communicator of layout.num_ranks() ranks) is made here too and owned
// with the mesh. invalid_argument for a bad layout or a rank outside it.
struct CountingMesh {
  std::unique_ptr<CountingCommunicator> world;
  std::unique_ptr<Mesh> mesh;
};
Result<CountingMesh> make_counting_mesh(const MeshLayout& layout, int world_rank, EventOrder& order, CommTrace& trace);

}  // namespace foldpar
