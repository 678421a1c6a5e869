// Checking mode, the backend-independent half: the descriptor of a collective that every
// rank shares before running it, and the comparison that names the ranks that disagree.
// A backend exchanges descriptors over a shadow of the communicator (the k-th exchange of
// every rank belongs to its k-th collective, so ranks compare what each calls at the same
// sequence number); a rank that skipped a collective shows up calling its next one.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/comm_op.h"

namespace foldpar {

// Sent as raw bytes between ranks of one job (same build, same layout). Fields that do not
// apply to an operation are normalized (root -1, reduce_op 0xff, zero counts hash), so two
// ranks agree exactly when their descriptors are equal.
struct CollectiveDescriptor {
  uint64_t seq = 0;
  uint64_t count = 0;        // the op's count; for the _v forms the sum of counts[]
  uint64_t counts_hash = 0;  // the _v forms: FNV-1a of counts[]
  int32_t root = -1;         // broadcast, reduce
  uint8_t kind = 0;          // CommOpKind
  uint8_t dtype = 0;         // DType; 0 for barrier
  uint8_t reduce_op = 0xff;  // ReduceOp of reductions
  uint8_t pad = 0;

  friend bool operator==(const CollectiveDescriptor&, const CollectiveDescriptor&) = default;
};
static_assert(std::is_trivially_copyable_v<CollectiveDescriptor> && sizeof(CollectiveDescriptor) == 32);

// op must be a collective with its seq assigned.
CollectiveDescriptor describe_collective(const CommOp& op);

// "all_reduce #5 (count 100, F32, sum)", "all_gather_v #2 (counts sum 9, hash 0x1f.., BF16)".
std::string descriptor_to_string(const CollectiveDescriptor& d);

// all[r] is what rank r of the communicator calls; world_ranks[r] its world rank. Returns ""
// when every rank agrees; otherwise a message naming the ranks that disagree with the
// largest group and what every group calls, e.g.
//   "ranks disagree at collective #5 on communicator world (world ranks 0-2): rank 1
//    calls all_gather #5 (count 10, F32); ranks 0,2 call all_reduce #5 (count 100, F32,
//    sum); disagreeing: rank 1"
std::string find_disagreement(std::span<const CollectiveDescriptor> all, std::span<const int> world_ranks,
                              const std::string& comm_description);

}  // namespace foldpar
