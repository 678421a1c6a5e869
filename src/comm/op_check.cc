// Checking-mode descriptors and the message that names disagreeing ranks.
#include "comm/op_check.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"

namespace foldpar {

namespace {

uint64_t fnv1a(std::span<const size_t> counts) {
  uint64_t h = 1469598103934665603ull;
  for (size_t c : counts) {
    for (int byte = 0; byte < 8; ++byte) {
      h ^= (static_cast<uint64_t>(c) >> (8 * byte)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  return h;
}

bool is_reduction(CommOpKind k) {
  return k == CommOpKind::kReduce || k == CommOpKind::kAllReduce || k == CommOpKind::kReduceScatter ||
         k == CommOpKind::kReduceScatterV;
}

// "rank 1", "ranks 0,2", with world ranks when they differ: "ranks 0,1 (world 2,3)".
std::string format_ranks(const std::vector<int>& ranks, std::span<const int> world_ranks) {
  std::string local, world;
  bool differs = false;
  for (int r : ranks) {
    local += fmt::format("{}{}", local.empty() ? "" : ",", r);
    world += fmt::format("{}{}", world.empty() ? "" : ",", world_ranks[r]);
    differs = differs || world_ranks[r] != r;
  }
  std::string out = fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", local);
  if (differs) out += fmt::format(" (world {})", world);
  return out;
}

}  // namespace

CollectiveDescriptor describe_collective(const CommOp& op) {
  FP_CHECK(is_collective(op.kind), "{} is not a collective", comm_op_name(op.kind));
  CollectiveDescriptor d;
  d.seq = op.seq;
  d.kind = static_cast<uint8_t>(op.kind);
  if (op.kind == CommOpKind::kBarrier) return d;
  d.dtype = static_cast<uint8_t>(op.dtype);
  if (op.kind == CommOpKind::kAllGatherV || op.kind == CommOpKind::kReduceScatterV) {
    for (size_t c : op.counts) d.count += c;
    d.counts_hash = fnv1a(op.counts);
  } else {
    d.count = op.count;
  }
  if (op.kind == CommOpKind::kBroadcast || op.kind == CommOpKind::kReduce) d.root = op.root;
  if (is_reduction(op.kind)) d.reduce_op = static_cast<uint8_t>(op.reduce_op);
  return d;
}

std::string descriptor_to_string(const CollectiveDescriptor& d) {
  const auto kind = static_cast<CommOpKind>(d.kind);
  std::string out = fmt::format("{} #{}", comm_op_name(kind), d.seq);
  if (kind == CommOpKind::kBarrier) return out;
  if (d.counts_hash != 0) {
    out += fmt::format(" (counts sum {}, counts hash {:#x}", d.count, d.counts_hash);
  } else {
    out += fmt::format(" (count {}", d.count);
  }
  out += fmt::format(", {}", dtype_name(static_cast<DType>(d.dtype)));
  if (d.reduce_op != 0xff) out += fmt::format(", {}", reduce_op_name(static_cast<ReduceOp>(d.reduce_op)));
  if (d.root >= 0) out += fmt::format(", root {}", d.root);
  return out + ")";
}

std::string find_disagreement(std::span<const CollectiveDescriptor> all, std::span<const int> world_ranks,
                              const std::string& comm_description) {
  FP_CHECK(all.size() == world_ranks.size() && !all.empty());
  // Group ranks by what they call; the largest group (ties: the one holding the lowest
  // rank) is taken as the reference, every other rank disagrees.
  std::vector<std::vector<int>> groups;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return all[g[0]] == all[r]; });
    if (it == groups.end()) {
      groups.push_back({r});
    } else {
      it->push_back(r);
    }
  }
  if (groups.size() == 1) return "";
  std::stable_sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) { return a.size() > b.size(); });
  std::vector<int> disagreeing;
  std::string calls;
  for (size_t g = 1; g < groups.size(); ++g) {
    disagreeing.insert(disagreeing.end(), groups[g].begin(), groups[g].end());
    calls += fmt::format("{} call{} {}; ", format_ranks(groups[g], world_ranks), groups[g].size() == 1 ? "s" : "",
                         descriptor_to_string(all[groups[g][0]]));
  }
  calls += fmt::format("{} call{} {}", format_ranks(groups[0], world_ranks), groups[0].size() == 1 ? "s" : "",
                       descriptor_to_string(all[groups[0][0]]));
  std::sort(disagreeing.begin(), disagreeing.end());
  return fmt::format("ranks disagree at collective #{} on communicator {}: {}; disagreeing: {}", all[0].seq,
                     comm_description, calls, format_ranks(disagreeing, world_ranks));
}

}  // namespace foldpar
