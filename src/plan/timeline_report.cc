// The simulated timeline as a Chrome trace, and the lines saying what bounds it
// (plan/timeline.h).
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "plan/timeline.h"

namespace foldpar {
namespace {

// Slots per link class seen in a rank's transfers (at least 1 each, so the tids are stable).
struct TidLayout {
  int intra = 1, inter = 1;
  int tid(const TimelineOp& op) const {
    if (op.stream == Stream::kCompute) return 0;
    return op.stream == Stream::kCommIntra ? 1 + op.slot : 1 + intra + op.slot;
  }
};

TidLayout tid_layout(const RankTimeline& r) {
  TidLayout t;
  for (const TimelineOp& op : r.ops) {
    if (op.stream == Stream::kCommIntra) t.intra = std::max(t.intra, op.slot + 1);
    if (op.stream == Stream::kCommInter) t.inter = std::max(t.inter, op.slot + 1);
  }
  return t;
}

nlohmann::ordered_json thread_name(int pid, int tid, const std::string& name) {
  return {{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}};
}

const char* category(TimelineOp::Kind k) {
  switch (k) {
    case TimelineOp::Kind::kCompute: return "compute";
    case TimelineOp::Kind::kTransfer: return "comm";
    case TimelineOp::Kind::kStall: return "stall";
  }
  return "?";
}

nlohmann::ordered_json trace_event(int pid, int tid, const TimelineOp& op) {
  nlohmann::ordered_json e = {{"name", op.communicator.empty() ? op.name : op.name + " " + op.communicator},
                              {"cat", category(op.kind)},
                              {"ph", "X"},
                              {"ts", op.start * 1e6},
                              {"dur", (op.end - op.start) * 1e6},
                              {"pid", pid},
                              {"tid", tid}};
  nlohmann::ordered_json args = {{"class", op.op_class}};
  if (op.kind == TimelineOp::Kind::kCompute) {
    args["flops"] = op.flops;
    args["bytes"] = op.bytes;
    args["memory_bound"] = op.memory_bound;
  } else {
    args["communicator"] = op.communicator;
    args["request"] = op.request;
    if (op.kind == TimelineOp::Kind::kTransfer) {
      args["bytes_sent"] = op.bytes_sent;
      args["bytes_received"] = op.bytes_received;
    }
  }
  e["args"] = args;
  return e;
}

}  // namespace

std::string chrome_trace_json(const std::vector<RankTimeline>& ranks) {
  nlohmann::ordered_json events = nlohmann::ordered_json::array();
  for (const RankTimeline& r : ranks) {
    const TidLayout tids = tid_layout(r);
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", r.rank}, {"args", {{"name", fmt::format("rank {}", r.rank)}}}});
    events.push_back(thread_name(r.rank, 0, "compute"));
    for (int s = 0; s < tids.intra; ++s) events.push_back(thread_name(r.rank, 1 + s, fmt::format("comm intra-node {}", s)));
    for (int s = 0; s < tids.inter; ++s)
      events.push_back(thread_name(r.rank, 1 + tids.intra + s, fmt::format("comm inter-node {}", s)));
    for (const TimelineOp& op : r.ops) events.push_back(trace_event(r.rank, tids.tid(op), op));
  }
  nlohmann::ordered_json j = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  return j.dump(1) + "\n";
}

std::string explain_timeline(const std::vector<RankTimeline>& ranks) {
  if (ranks.empty()) return "no ranks simulated\n";
  const RankTimeline& r = *std::max_element(ranks.begin(), ranks.end(),
                                            [](const RankTimeline& a, const RankTimeline& b) { return a.step_s < b.step_s; });
  const double step = r.step_s > 0 ? r.step_s : 1.0;
  auto pct = [&](double s) { return 100.0 * s / step; };
  std::string out = fmt::format(
      "rank {} (the slowest of {}): step {:.4g} s = compute {:.4g} s ({:.0f}%) + exposed communication {:.4g} s ({:.0f}%); "
      "communication busy {:.4g} s\n",
      r.rank, ranks.size(), r.step_s, r.compute_s, pct(r.compute_s), r.exposed_comm_s, pct(r.exposed_comm_s), r.comm_busy_s);
  std::vector<const KindTotals*> exposed;
  for (const KindTotals& k : r.by_kind)
    if (k.transfer && k.exposed_s > 0) exposed.push_back(&k);
  std::sort(exposed.begin(), exposed.end(), [](const KindTotals* a, const KindTotals* b) { return a->exposed_s > b->exposed_s; });
  // The bound: the largest of the rate-bound compute, the memory-bound compute and each
  // collective's exposed time.
  const double rate_bound = r.compute_s - r.memory_bound_s;
  const double top_comm = exposed.empty() ? 0.0 : exposed.front()->exposed_s;
  if (top_comm > rate_bound && top_comm > r.memory_bound_s)
    out += fmt::format("bound by {} on {}: {:.4g} s exposed ({:.0f}% of the step, {} calls)\n", exposed.front()->kind,
                       exposed.front()->communicator, top_comm, pct(top_comm), exposed.front()->count);
  else if (r.memory_bound_s > rate_bound)
    out += fmt::format("bound by memory bandwidth: memory-bound ops take {:.4g} s ({:.0f}% of the step)\n", r.memory_bound_s,
                       pct(r.memory_bound_s));
  else
    out += fmt::format("compute-bound: compute at its FLOP rate takes {:.4g} s ({:.0f}% of the step)\n", rate_bound,
                       pct(rate_bound));
  double path_compute = 0, path_comm = 0;
  int path_transfers = 0;
  for (const TimelineOp& op : r.critical_path) {
    if (op.kind == TimelineOp::Kind::kTransfer) {
      path_comm += op.end - op.start;
      ++path_transfers;
    } else {
      path_compute += op.end - op.start;
    }
  }
  out += fmt::format("critical path: {:.4g} s of compute, {:.4g} s in {} transfers\n", path_compute, path_comm, path_transfers);
  for (size_t i = 0; i < exposed.size() && i < 3; ++i)
    out += fmt::format("  exposed: {} on {}: {:.4g} s ({:.0f}%) of {:.4g} s busy\n", exposed[i]->kind,
                       exposed[i]->communicator, exposed[i]->exposed_s, pct(exposed[i]->exposed_s), exposed[i]->busy_s);
  return out;
}

}  // namespace foldpar
