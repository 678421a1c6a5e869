// The timeline's pricing and simulation (plan/timeline.h); the Chrome trace and the
// explanation are timeline_report.cc.
#include "plan/timeline.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <tuple>

namespace foldpar {

const char* compute_class_name(ComputeClass c) {
  switch (c) {
    case ComputeClass::kGemm: return "gemm";
    case ComputeClass::kAttentionFwd: return "attention_fwd";
    case ComputeClass::kAttentionBwd: return "attention_bwd";
    case ComputeClass::kTokenwise: return "tokenwise";
    case ComputeClass::kOptimizer: return "optimizer";
    case ComputeClass::kOther: return "other";
  }
  return "?";
}

const char* comm_kind_name(CommKind k) {
  switch (k) {
    case CommKind::kBroadcast: return "broadcast";
    case CommKind::kReduce: return "reduce";
    case CommKind::kAllReduce: return "all_reduce";
    case CommKind::kAllGather: return "all_gather";
    case CommKind::kReduceScatter: return "reduce_scatter";
    case CommKind::kAllToAll: return "all_to_all";
    case CommKind::kSend: return "send";
    case CommKind::kRecv: return "recv";
    case CommKind::kSendRecv: return "send_recv";
    case CommKind::kBarrier: return "barrier";
  }
  return "?";
}

const char* link_class_name(LinkClass l) { return l == LinkClass::kIntraNode ? "intra_node" : "inter_node"; }

Result<LinkClass> link_class(const std::vector<int>& world_ranks, int devices_per_node) {
  if (world_ranks.empty()) return invalid_argument("link_class: a communicator has at least one rank (got none)");
  if (devices_per_node < 1) return invalid_argument("link_class: devices_per_node ({}) must be at least 1", devices_per_node);
  for (int r : world_ranks)
    if (r < 0) return invalid_argument("link_class: world rank ({}) must not be negative", r);
  const int node = world_ranks.front() / devices_per_node;
  for (int r : world_ranks)
    if (r / devices_per_node != node) return LinkClass::kInterNode;
  return LinkClass::kIntraNode;
}

namespace {

double compute_rate(const ComputeEvent& e, const Hardware& hw) {
  const double peak = hw.peak_flops(e.dtype == MathDType::kBF16);
  switch (e.op_class) {
    case ComputeClass::kGemm: {
      const int64_t min_dim = std::min({e.gemm.m, e.gemm.n, e.gemm.k});
      return peak * hw.gemm_efficiency(static_cast<double>(std::max<int64_t>(min_dim, 1)));
    }
    case ComputeClass::kAttentionFwd: return peak * hw.attention_fwd_rate(static_cast<double>(e.attention.seq_k));
    case ComputeClass::kAttentionBwd: return peak * hw.attention_bwd_rate(static_cast<double>(e.attention.seq_k));
    default: return peak * hw.matmul_efficiency;
  }
}

// GEMMs and attention stream at memory_gb_per_s; every other op at its own calibrated rate
// where the hardware lists one (Hardware::tokenwise_gb_per_s).
double memory_seconds(const ComputeEvent& e, const Hardware& hw) {
  const bool kernel = e.op_class == ComputeClass::kGemm || e.op_class == ComputeClass::kAttentionFwd ||
                      e.op_class == ComputeClass::kAttentionBwd;
  const double rate = kernel ? hw.memory_gb_per_s : hw.tokenwise_gb_per_s(e.op);
  return rate > 0 ? e.bytes / (rate * 1e9) : 0.0;
}

}  // namespace

double compute_seconds(const ComputeEvent& e, const Hardware& hw) {
  return std::max(e.flops / compute_rate(e, hw), memory_seconds(e, hw));
}

bool memory_bound(const ComputeEvent& e, const Hardware& hw) {
  return memory_seconds(e, hw) > e.flops / compute_rate(e, hw);
}

int latency_steps(CommKind kind, int comm_size) {
  const int n = comm_size;
  if (n <= 1) return 0;
  switch (kind) {
    case CommKind::kAllGather:
    case CommKind::kReduceScatter:
    case CommKind::kAllToAll:
    case CommKind::kBroadcast:
    case CommKind::kReduce: return n - 1;
    case CommKind::kAllReduce: return 2 * (n - 1);
    case CommKind::kSend:
    case CommKind::kRecv:
    case CommKind::kSendRecv: return 1;
    case CommKind::kBarrier: return static_cast<int>(std::ceil(std::log2(static_cast<double>(n))));
  }
  return 0;
}

double transfer_seconds(const CommStart& s, const Hardware& hw) {
  if (s.comm_size <= 1) return 0;
  const bool intra = s.link == LinkClass::kIntraNode;
  const double latency = intra ? hw.intra_node_latency_s : hw.inter_node_latency_s;
  const double bytes = static_cast<double>(std::max(s.bytes_sent, s.bytes_received));
  const std::string kind = comm_kind_name(s.kind);
  double by_size = s.blocking ? 0 : hw.table_gb_per_s(intra, "i" + kind, bytes);  // the non-blocking form's own
  if (by_size == 0) by_size = hw.table_gb_per_s(intra, kind, bytes);
  const double rate = by_size > 0 ? 1e9 * by_size
                                  : 1e9 * (intra ? hw.intra_node_gb_per_s : hw.inter_node_gb_per_s) *
                                        hw.collective_efficiency_of(kind);
  return latency_steps(s.kind, s.comm_size) * latency + bytes / rate;
}

namespace {

class RankSimulator;

// Point-to-point transfers between ranks simulated together (simulate_coupled): the n-th
// send from A to B on a communicator with a tag meets B's n-th receive from A with that tag;
// both start when the later one is posted.
class P2pMatcher {
 public:
  struct Post {
    size_t sim = 0, transfer = 0;  // whose transfer (RankSimulator index, its transfers_ index)
    double posted = 0, seconds = 0;
  };
  // Simulators in index order (Post::sim).
  void add_rank(int world_rank, RankSimulator* sim) {
    sims_[world_rank] = sim;
    by_index_.push_back(sim);
  }
  bool coupled(int world_rank) const { return sims_.count(world_rank) > 0; }
  bool coupled(const std::vector<int>& members) const {
    if (members.empty()) return false;
    for (int r : members)
      if (!coupled(r)) return false;
    return true;
  }
  void post(bool send, int from, int to, const std::string& comm, int tag, const Post& p);
  // A collective of `members` (all coupled), posted by world rank `rank`: the n-th of each
  // member on (comm, members) meet, and start when the last is posted.
  void post_collective(int rank, const std::string& comm, const std::vector<int>& members, const Post& p);

 private:
  using Key = std::tuple<int, int, std::string, int>;  // sender, receiver, communicator, tag
  using Group = std::pair<std::string, std::vector<int>>;  // communicator, its world ranks
  std::map<int, RankSimulator*> sims_;  // by world rank
  std::vector<RankSimulator*> by_index_;
  std::map<Key, std::deque<Post>> sends_, recvs_;  // posts not matched yet
  std::map<std::pair<Group, int>, int64_t> posted_;                // (group, rank) -> collectives posted
  std::map<std::pair<Group, int64_t>, std::vector<Post>> rounds_;  // (group, n) -> its posts so far
};

// The simulation's state for one rank. Compute-stream items (compute ops and stalls) are
// kept in program order; transfers in posting order, with what each waited for, so the
// critical path can be walked back from the step's end. With a matcher, advance() stops at a
// wait on a transfer whose peer has not posted yet, and resumes there.
class RankSimulator {
 public:
  RankSimulator(const Hardware& hw, int world_rank = 0, P2pMatcher* matcher = nullptr, size_t index = 0)
      : hw_(hw), world_rank_(world_rank), matcher_(matcher), index_(index) {
    for (int d = 0; d < 2; ++d) {
      slots_free_[0][d].assign(static_cast<size_t>(hw.intra_node_concurrency), 0.0);
      slots_free_[1][d].assign(static_cast<size_t>(hw.inter_node_concurrency), 0.0);
      slot_last_[0][d].assign(slots_free_[0][d].size(), -1);
      slot_last_[1][d].assign(slots_free_[1][d].size(), -1);
    }
  }

  Status run(const RankTrace& trace) {
    bool progressed = false;
    FP_RETURN_IF_ERROR(advance(trace, progressed));
    return finish(trace);
  }

  // Handles events until the trace ends or a wait blocks on an unmatched transfer.
  Status advance(const RankTrace& trace, bool& progressed) {
    if (stuck_) {
      FP_RETURN_IF_ERROR(handle(CommWait{*stuck_}).with_context(fmt::format("rank {}", trace.rank)));
      if (stuck_) return Status();
      progressed = true;
    }
    while (next_ < trace.events.size()) {
      const size_t i = next_++;
      Status st = std::visit([&](const auto& e) { return handle(e); }, trace.events[i]);
      if (!st.ok()) return st.with_context(fmt::format("rank {} event {}", trace.rank, i));
      progressed = true;
      if (stuck_) return Status();
    }
    return Status();
  }
  bool done(const RankTrace& trace) const { return !stuck_ && next_ == trace.events.size(); }
  // The request this rank waits on and the peer it waits for, for a deadlock's message.
  std::string stuck_on() const {
    if (!stuck_) return "nothing";
    const Transfer& t = transfers_[pending_.at(*stuck_)];
    return fmt::format("request {} ({} on {}, peer {})", *stuck_, t.op.name, t.op.communicator, t.peer);
  }

  Status finish(const RankTrace& trace) const {
    for (const auto& [request, index] : pending_)
      return invalid_argument("rank {}: request {} ({} on {}) is never waited", trace.rank, request,
                              transfers_[index].op.name, transfers_[index].op.communicator);
    return Status();
  }

  // The matcher's answer for one leg of a coupled transfer: it starts when its last leg does.
  void resolve(size_t transfer, double start, double end) {
    Transfer& t = transfers_[transfer];
    t.op.start = std::max(t.op.start, start);
    t.op.end = std::max(t.op.end, end);
    t.resolved = --t.legs == 0;
  }

  RankTimeline result(int rank) const;

 private:
  struct Transfer {
    TimelineOp op;
    double posted = 0;
    size_t posted_after = 0;  // compute-stream items before it was posted
    int64_t slot_prev = -1;   // the transfer it queued behind on its slot, or -1 (started when posted)
    bool resolved = true;     // false: a coupled transfer whose peer has not posted yet
    int legs = 0;             // coupled: its matches still to come (a send_recv has two)
    int peer = -1;
  };

  Status handle(const ComputeEvent& e) {
    if (!(e.flops >= 0 && e.bytes >= 0))
      return invalid_argument("compute op '{}': flops ({}) and bytes ({}) must not be negative", e.op, e.flops, e.bytes);
    TimelineOp op;
    op.kind = TimelineOp::Kind::kCompute;
    op.name = e.op;
    op.op_class = compute_class_name(e.op_class);
    op.start = now_;
    op.end = now_ + compute_seconds(e, hw_);
    op.flops = e.flops;
    op.bytes = e.bytes;
    op.memory_bound = memory_bound(e, hw_);
    now_ = op.end;
    items_.push_back(op);
    return Status();
  }

  Status handle(const CommStart& s) {
    if (seen_.count(s.request)) return invalid_argument("request {} is started twice", s.request);
    if (s.comm_size < 1) return invalid_argument("request {}: comm_size ({}) must be at least 1", s.request, s.comm_size);
    seen_.insert(s.request);
    const int link = s.link == LinkClass::kIntraNode ? 0 : 1;
    const bool p2p = s.kind == CommKind::kSend || s.kind == CommKind::kRecv;
    const bool collective = !p2p && s.kind != CommKind::kSendRecv;
    const bool coupled = matcher_ != nullptr &&
                         ((p2p && s.peer >= 0 && matcher_->coupled(s.peer)) ||
                          (s.kind == CommKind::kSendRecv && s.peer >= 0 && s.source >= 0 &&
                           matcher_->coupled(s.peer) && matcher_->coupled(s.source)) ||
                          (collective && s.comm_size > 1 && static_cast<int>(s.members.size()) == s.comm_size &&
                           matcher_->coupled(s.members)));
    Transfer t;
    t.posted = now_;
    t.posted_after = items_.size();
    t.peer = s.peer;
    t.op.kind = TimelineOp::Kind::kTransfer;
    t.op.name = comm_kind_name(s.kind);
    t.op.op_class = t.op.name;
    t.op.communicator = s.communicator;
    t.op.stream = link == 0 ? Stream::kCommIntra : Stream::kCommInter;
    t.op.bytes = static_cast<double>(std::max(s.bytes_sent, s.bytes_received));
    t.op.bytes_sent = s.bytes_sent;
    t.op.bytes_received = s.bytes_received;
    t.op.request = s.request;
    if (coupled) {
      t.resolved = false;
      t.legs = s.kind == CommKind::kSendRecv ? 2 : 1;
      t.op.start = t.op.end = -std::numeric_limits<double>::infinity();  // until its legs are matched
    } else {
      // The directions it occupies: a send only the outgoing one, a receive only the
      // incoming one, anything that moves both ways (or nothing: a barrier) both. The slot
      // free soonest in those directions takes it.
      const bool out = s.bytes_sent > 0 || s.bytes_received == 0, in = s.bytes_received > 0 || s.bytes_sent == 0;
      auto ready = [&](size_t slot) {
        double r = 0;
        if (out) r = std::max(r, slots_free_[link][0][slot]);
        if (in) r = std::max(r, slots_free_[link][1][slot]);
        return r;
      };
      size_t slot = 0;
      for (size_t k = 1; k < slots_free_[link][0].size(); ++k)
        if (ready(k) < ready(slot)) slot = k;
      t.op.slot = static_cast<int>(slot);
      t.op.start = std::max(now_, ready(slot));
      if (ready(slot) > now_) {  // queued behind the direction that frees last
        const int d = out && (!in || slots_free_[link][0][slot] >= slots_free_[link][1][slot]) ? 0 : 1;
        t.slot_prev = slot_last_[link][d][slot];
      }
      t.op.end = t.op.start + transfer_seconds(s, hw_);
      for (int d = 0; d < 2; ++d) {
        if (d == 0 ? !out : !in) continue;
        slots_free_[link][d][slot] = t.op.end;
        slot_last_[link][d][slot] = static_cast<int64_t>(transfers_.size());
      }
    }
    pending_[s.request] = transfers_.size();
    transfers_.push_back(t);
    if (coupled) {
      const P2pMatcher::Post post{index_, transfers_.size() - 1, now_, transfer_seconds(s, hw_)};
      if (collective) {
        matcher_->post_collective(world_rank_, s.communicator, s.members, post);
      } else if (s.kind == CommKind::kSendRecv) {  // a send to peer and a receive from source
        matcher_->post(true, world_rank_, s.peer, s.communicator, s.tag, post);
        matcher_->post(false, s.source, world_rank_, s.communicator, s.tag, post);
      } else {
        const bool send = s.kind == CommKind::kSend;
        matcher_->post(send, send ? world_rank_ : s.peer, send ? s.peer : world_rank_, s.communicator, s.tag, post);
      }
    }
    if (s.blocking) return handle(CommWait{s.request});
    return Status();
  }

  Status handle(const CommWait& w) {
    auto it = pending_.find(w.request);
    if (it == pending_.end())
      return invalid_argument("wait on request {}, which is {}", w.request,
                              seen_.count(w.request) ? "already waited (or blocking)" : "never started");
    const Transfer& t = transfers_[it->second];
    if (!t.resolved) {  // its peer has not posted yet: resume here once it has
      stuck_ = w.request;
      return Status();
    }
    stuck_.reset();
    // Where a processor moves the bytes (Hardware::*_copy_share), the wait also pays this
    // rank's share of the transfer's time on the compute stream, however early it began.
    const double share = t.op.stream == Stream::kCommIntra ? hw_.intra_node_copy_share : hw_.inter_node_copy_share;
    const double copied = now_ + share * (t.op.end - t.op.start);
    if (t.op.end > now_ || copied > now_) {
      TimelineOp stall;
      stall.kind = TimelineOp::Kind::kStall;
      stall.name = "wait " + t.op.name;
      stall.op_class = t.op.name;
      stall.communicator = t.op.communicator;
      stall.start = now_;
      stall.end = std::max(t.op.end, copied);
      stall.request = w.request;
      now_ = stall.end;
      // A stall the transfer's end bounds leads the critical path to the transfer; one the
      // copy bounds leads to the compute before it.
      if (t.op.end >= copied) stall_transfer_[items_.size()] = it->second;
      items_.push_back(stall);
    }
    pending_.erase(it);
    return Status();
  }

  std::vector<TimelineOp> critical_path() const;

  const Hardware& hw_;
  int world_rank_ = 0;
  P2pMatcher* matcher_ = nullptr;  // simulate_coupled's; null: every peer symmetric and present
  size_t index_ = 0;               // this simulator's index in the matcher's posts
  size_t next_ = 0;                // the next trace event
  std::optional<int64_t> stuck_;   // the request a wait blocks on (coupled, peer not posted)
  double now_ = 0;  // the compute stream's clock
  // [link class][direction: 0 out, 1 in][slot]: when it is free, and its last transfer.
  std::vector<double> slots_free_[2][2];
  std::vector<int64_t> slot_last_[2][2];
  std::vector<TimelineOp> items_;
  std::vector<Transfer> transfers_;
  std::map<int64_t, size_t> pending_;        // request -> transfers_ index, not yet waited
  std::set<int64_t> seen_;                   // every request started
  std::map<size_t, size_t> stall_transfer_;  // items_ index of a stall -> the transfer it waited on
};

void P2pMatcher::post(bool send, int from, int to, const std::string& comm, int tag, const Post& p) {
  const Key key{from, to, comm, tag};
  auto& mine = send ? sends_[key] : recvs_[key];
  auto& other = send ? recvs_[key] : sends_[key];
  if (other.empty()) {
    mine.push_back(p);
    return;
  }
  const Post o = other.front();
  other.pop_front();
  const double start = std::max(p.posted, o.posted), end = start + std::max(p.seconds, o.seconds);
  by_index_[p.sim]->resolve(p.transfer, start, end);
  by_index_[o.sim]->resolve(o.transfer, start, end);
}

void P2pMatcher::post_collective(int rank, const std::string& comm, const std::vector<int>& members, const Post& p) {
  Group group{comm, members};
  const int64_t n = posted_[{group, rank}]++;
  auto key = std::make_pair(std::move(group), n);
  std::vector<Post>& round = rounds_[key];
  round.push_back(p);
  if (round.size() < members.size()) return;
  double start = 0, seconds = 0;
  for (const Post& q : round) {
    start = std::max(start, q.posted);
    seconds = std::max(seconds, q.seconds);
  }
  for (const Post& q : round) by_index_[q.sim]->resolve(q.transfer, start, start + seconds);
  rounds_.erase(key);
}

// Walks back from the compute stream's end: a compute op leads to the item before it; a
// stall leads to the transfer that ended it; a transfer leads to the transfer it queued
// behind on its slot, or else to the compute item before its posting.
std::vector<TimelineOp> RankSimulator::critical_path() const {
  std::vector<TimelineOp> path;
  int64_t item = static_cast<int64_t>(items_.size()) - 1;
  while (item >= 0) {
    const auto stall = stall_transfer_.find(static_cast<size_t>(item));
    if (stall == stall_transfer_.end()) {
      path.push_back(items_[static_cast<size_t>(item)]);
      --item;
      continue;
    }
    int64_t tr = static_cast<int64_t>(stall->second);
    while (true) {
      const Transfer& t = transfers_[static_cast<size_t>(tr)];
      path.push_back(t.op);
      if (t.slot_prev < 0) {
        item = static_cast<int64_t>(t.posted_after) - 1;
        break;
      }
      tr = t.slot_prev;
    }
  }
  std::reverse(path.begin(), path.end());
  return path;
}

KindTotals& totals_for(std::vector<KindTotals>& v, const TimelineOp& op) {
  const bool transfer = op.kind != TimelineOp::Kind::kCompute;
  for (KindTotals& t : v)
    if (t.kind == op.op_class && t.communicator == op.communicator && t.transfer == transfer) return t;
  v.push_back(KindTotals{op.op_class, op.communicator, transfer});
  return v.back();
}

RankTimeline RankSimulator::result(int rank) const {
  RankTimeline r;
  r.rank = rank;
  r.step_s = now_;
  for (const TimelineOp& op : items_) {
    KindTotals& k = totals_for(r.by_kind, op);
    if (op.kind == TimelineOp::Kind::kCompute) {
      r.compute_s += op.end - op.start;
      if (op.memory_bound) r.memory_bound_s += op.end - op.start;
      k.count += 1;
      k.busy_s += op.end - op.start;
      k.flops += op.flops;
      k.bytes += op.bytes;
    } else {
      r.exposed_comm_s += op.end - op.start;
      k.exposed_s += op.end - op.start;
    }
    r.ops.push_back(op);
  }
  for (const Transfer& t : transfers_) {
    KindTotals& k = totals_for(r.by_kind, t.op);
    k.count += 1;
    k.busy_s += t.op.end - t.op.start;
    k.bytes += t.op.bytes;
    r.comm_busy_s += t.op.end - t.op.start;
    r.ops.push_back(t.op);
  }
  // Compute kinds first, then transfers, each in first-seen order.
  std::stable_partition(r.by_kind.begin(), r.by_kind.end(), [](const KindTotals& k) { return !k.transfer; });
  r.critical_path = critical_path();
  return r;
}

}  // namespace

Result<RankTimeline> simulate_rank(const RankTrace& trace, const Hardware& hw) {
  FP_RETURN_IF_ERROR(hw.validate());
  RankSimulator sim(hw);
  FP_RETURN_IF_ERROR(sim.run(trace));
  return sim.result(trace.rank);
}

Result<std::vector<RankTimeline>> simulate_coupled(const std::vector<RankTrace>& traces, const Hardware& hw) {
  FP_RETURN_IF_ERROR(hw.validate());
  P2pMatcher matcher;
  std::vector<std::unique_ptr<RankSimulator>> sims;
  for (size_t i = 0; i < traces.size(); ++i) {
    if (matcher.coupled(traces[i].rank))
      return invalid_argument("simulate_coupled: rank {} is given twice", traces[i].rank);
    sims.push_back(std::make_unique<RankSimulator>(hw, traces[i].rank, &matcher, i));
    matcher.add_rank(traces[i].rank, sims.back().get());
  }
  while (true) {
    bool progressed = false, all_done = true;
    for (size_t i = 0; i < sims.size(); ++i) {
      FP_RETURN_IF_ERROR(sims[i]->advance(traces[i], progressed));
      all_done = all_done && sims[i]->done(traces[i]);
    }
    if (all_done) break;
    if (!progressed) {
      for (size_t i = 0; i < sims.size(); ++i)
        if (!sims[i]->done(traces[i]))
          return invalid_argument("simulate_coupled: the ranks wait on each other for ever: rank {} waits on {}",
                                  traces[i].rank, sims[i]->stuck_on());
    }
  }
  std::vector<RankTimeline> out;
  for (size_t i = 0; i < sims.size(); ++i) {
    FP_RETURN_IF_ERROR(sims[i]->finish(traces[i]));
    out.push_back(sims[i]->result(traces[i].rank));
  }
  return out;
}

Result<std::vector<RankTimeline>> simulate_ranks(const std::vector<RankTrace>& traces, const Hardware& hw) {
  std::vector<RankTimeline> out;
  out.reserve(traces.size());
  for (const RankTrace& t : traces) {
    FP_ASSIGN_OR_RETURN(RankTimeline r, simulate_rank(t, hw));
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace foldpar
