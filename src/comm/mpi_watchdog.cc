// The watchdog thread: registry of operations in flight, status queries between ranks, and
// the report that ends a hung job.
#include "comm/mpi_watchdog.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/check.h"

namespace foldpar::mpi_detail {

namespace {

constexpr int kQueryTag = 7001;
constexpr int kAnswerTag = 7002;

struct QueryMsg {
  uint64_t key;
};
struct AnswerMsg {
  int64_t entered;     // -1: this rank does not know the communicator
  int32_t purposeful;  // 1: it waits in an operation with a purpose
  char state[1012];    // room for a few operations with their purposes
};

double seconds_since(CoarseClock::time_point t, CoarseClock::time_point now) {
  return std::chrono::duration<double>(now - t).count();
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += fmt::format("{}{}", out.empty() ? "" : ",", r);
  return out;
}

}  // namespace

MpiWatchdog::MpiWatchdog(const MpiContext& ctx, double timeout_s, bool can_query)
    : ctx_(ctx), timeout_s_(timeout_s), can_query_(can_query) {
  FP_CHECK(timeout_s_ > 0, "watchdog timeout {} s", timeout_s_);
  FP_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
  FP_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  thread_ = std::thread([this] { loop(); });
}

MpiWatchdog::~MpiWatchdog() {
  {
    std::lock_guard lock(wake_mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
  FP_MPI_CHECK(MPI_Comm_free(&comm_));
}

uint64_t MpiWatchdog::begin(const Communicator& comm, uint64_t key, const CommOp& op, bool waiting) {
  const Clock::time_point now = Clock::now();
  std::lock_guard lock(registry_);
  const uint64_t token = next_token_++;
  inflight_.push_back({token, &comm, key, op.kind, op.seq, op.peer, op.source, op.purpose, now, waiting, now});
  return token;
}

void MpiWatchdog::wait_begins(uint64_t token) {
  const Clock::time_point now = Clock::now();
  std::lock_guard lock(registry_);
  auto it = std::find_if(inflight_.begin(), inflight_.end(), [&](const Inflight& op) { return op.token == token; });
  FP_CHECK(it != inflight_.end(), "watchdog token {} is not in flight", token);
  if (!it->waiting) it->waiting_since = now;
  it->waiting = true;
}

void MpiWatchdog::end(uint64_t token) {
  std::lock_guard lock(registry_);
  auto it = std::find_if(inflight_.begin(), inflight_.end(), [&](const Inflight& op) { return op.token == token; });
  FP_CHECK(it != inflight_.end(), "watchdog token {} is not in flight", token);
  inflight_.erase(it);
}

void MpiWatchdog::add_comm(uint64_t key, const Communicator* comm) {
  std::lock_guard lock(registry_);
  FP_CHECK(comms_.emplace(key, comm).second, "communicator {} registered twice", comm->describe());
}

void MpiWatchdog::remove_comm(uint64_t key) {
  std::lock_guard lock(registry_);
  for (const Inflight& op : inflight_) {
    FP_CHECK(op.key != key, "communicator {} destroyed while {} #{} is in flight", op.comm->describe(),
             comm_op_name(op.kind), op.seq);
  }
  comms_.erase(key);
}

void MpiWatchdog::loop() {
  const auto poll = std::chrono::duration<double>(std::min(0.1, timeout_s_ / 4));
  while (true) {
    {
      std::unique_lock lock(wake_mu_);
      wake_.wait_for(lock, poll, [this] { return stop_; });
      if (stop_) return;
    }
    std::optional<Expired> expired;
    {
      std::lock_guard lock(registry_);
      const Clock::time_point now = Clock::now();
      const Inflight* oldest = nullptr;
      for (const Inflight& op : inflight_) {
        if (op.waiting && seconds_since(op.waiting_since, now) >= timeout_s_ &&
            (oldest == nullptr || op.waiting_since < oldest->waiting_since)) {
          oldest = &op;
        }
      }
      if (oldest != nullptr) expired = snapshot(*oldest, now);
    }
    if (expired) diagnose(*expired);
    if (can_query_) answer_queries();
  }
}

std::string MpiWatchdog::describe_op(const Inflight& op, Clock::time_point now) const {
  std::string peers;
  if (op.kind == CommOpKind::kSend || op.kind == CommOpKind::kSendRecv) peers += fmt::format(" to rank {}", op.peer);
  if (op.kind == CommOpKind::kRecv || op.kind == CommOpKind::kSendRecv) peers += fmt::format(" from rank {}", op.source);
  std::string out = fmt::format("{} #{}{} on {} for {:.1f} s", comm_op_name(op.kind), op.seq, peers, op.comm->name(),
                                seconds_since(op.waiting ? op.waiting_since : op.start, now));
  // The purpose says what never arrived: true only of an operation the rank waits for.
  if (op.waiting && op.purpose.format != nullptr) out += fmt::format(" ({})", describe_purpose(op.purpose));
  return out;
}

std::string MpiWatchdog::describe_self(uint64_t key, int64_t* entered, bool* purposeful) {
  auto it = comms_.find(key);
  *entered = it == comms_.end() ? -1 : static_cast<int64_t>(it->second->collectives_submitted());
  *purposeful = false;
  const Clock::time_point now = Clock::now();
  std::string waiting, started;
  for (const Inflight& op : inflight_) {
    std::string& list = op.waiting ? waiting : started;
    list += fmt::format("{}{}", list.empty() ? "" : ", ", describe_op(op, now));
    *purposeful = *purposeful || (op.waiting && op.purpose.format != nullptr);
  }
  if (waiting.empty() && started.empty()) return "not inside any communication";
  if (waiting.empty()) return "not waiting in any communication; started, not yet waited for: " + started;
  return "in " + waiting + (started.empty() ? "" : "; started, not yet waited for: " + started);
}

MpiWatchdog::Expired MpiWatchdog::snapshot(const Inflight& op, Clock::time_point now) const {
  Expired e{op, "", op.comm->name(), op.comm->world_ranks(), op.comm->rank()};
  std::string peers;
  if (op.kind == CommOpKind::kSend || op.kind == CommOpKind::kSendRecv) peers += fmt::format(" to rank {}", op.peer);
  if (op.kind == CommOpKind::kRecv || op.kind == CommOpKind::kSendRecv) peers += fmt::format(" from rank {}", op.source);
  const double waited = seconds_since(op.waiting_since, now);
  const char* kind = is_collective(op.kind) ? "collective" : "point-to-point";
  if (op.purpose.format != nullptr) {
    e.what = fmt::format("{} after {:.1f} s: {} {} #{}{} on communicator {} has not completed (timeout {} s)",
                         describe_purpose(op.purpose), waited, kind, comm_op_name(op.kind), op.seq, peers,
                         op.comm->describe(), timeout_s_);
  } else {
    e.what = fmt::format("{} {} #{}{} on communicator {} has not completed after {:.1f} s (timeout {} s)", kind,
                         comm_op_name(op.kind), op.seq, peers, op.comm->describe(), waited, timeout_s_);
  }
  return e;
}

void MpiWatchdog::answer_queries() {
  while (true) {
    int pending = 0;
    MPI_Status status;
    FP_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, comm_, &pending, &status));
    if (!pending) return;
    QueryMsg query{};
    FP_MPI_CHECK(MPI_Recv(&query, sizeof query, MPI_BYTE, status.MPI_SOURCE, kQueryTag, comm_, MPI_STATUS_IGNORE));
    AnswerMsg answer{};
    std::string state;
    bool purposeful = false;
    {
      std::lock_guard lock(registry_);
      state = describe_self(query.key, &answer.entered, &purposeful);
    }
    answer.purposeful = purposeful ? 1 : 0;
    std::strncpy(answer.state, state.c_str(), sizeof answer.state - 1);
    FP_MPI_CHECK(MPI_Send(&answer, sizeof answer, MPI_BYTE, status.MPI_SOURCE, kAnswerTag, comm_));
  }
}

std::vector<MpiWatchdog::Answer> MpiWatchdog::query(uint64_t key, const std::vector<int>& world_targets) {
  const size_t n = world_targets.size();
  std::vector<Answer> answers(n);
  if (!can_query_ || n == 0) return answers;
  const QueryMsg query{key};
  std::vector<AnswerMsg> msgs(n);
  std::vector<MPI_Request> sends(n), recvs(n);
  for (size_t i = 0; i < n; ++i) {
    FP_MPI_CHECK(MPI_Isend(&query, sizeof query, MPI_BYTE, world_targets[i], kQueryTag, comm_, &sends[i]));
    FP_MPI_CHECK(MPI_Irecv(&msgs[i], sizeof msgs[i], MPI_BYTE, world_targets[i], kAnswerTag, comm_, &recvs[i]));
  }
  // Other ranks may be diagnosing at the same time: keep answering them while waiting.
  const double grace_s = std::clamp(timeout_s_ / 2, 1.0, 10.0);
  const Clock::time_point deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                         std::chrono::duration<double>(grace_s));
  size_t answered = 0;
  while (answered < n && Clock::now() < deadline) {
    for (size_t i = 0; i < n; ++i) {
      if (answers[i].answered) continue;
      int done = 0;
      FP_MPI_CHECK(MPI_Test(&recvs[i], &done, MPI_STATUS_IGNORE));
      if (!done) continue;
      msgs[i].state[sizeof msgs[i].state - 1] = '\0';
      answers[i] = {true, msgs[i].entered, msgs[i].purposeful != 0, msgs[i].state};
      ++answered;
    }
    answer_queries();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // The job is about to be aborted: unanswered requests are left to MPI_Abort.
  return answers;
}

std::string MpiWatchdog::rank_name(const Expired& e, int rank) const {
  const int world = e.world_ranks[rank];
  return fmt::format("rank {} (world {} on {})", rank, world, ctx_.hosts[world]);
}

void MpiWatchdog::diagnose(const Expired& e) {
  const Inflight& op = e.op;
  std::vector<int> ranks;  // ranks of the communicator asked
  if (is_collective(op.kind)) {
    for (int r = 0; r < static_cast<int>(e.world_ranks.size()); ++r) {
      if (r != e.rank) ranks.push_back(r);
    }
  } else {
    if (op.peer >= 0 && op.peer != e.rank) ranks.push_back(op.peer);
    if (op.source >= 0 && op.source != e.rank && op.source != op.peer) ranks.push_back(op.source);
  }
  // The communicator's ranks first, then the rest of the job, in one query (one grace period).
  std::vector<int> world_targets;
  for (int r : ranks) world_targets.push_back(e.world_ranks[r]);
  std::vector<int> others;
  for (int w = 0; w < ctx_.world_size; ++w)
    if (w != ctx_.world_rank && std::find(world_targets.begin(), world_targets.end(), w) == world_targets.end())
      others.push_back(w);
  world_targets.insert(world_targets.end(), others.begin(), others.end());
  const std::vector<Answer> answers = query(op.key, world_targets);

  std::string message = "watchdog: " + e.what;
  if (!can_query_) {
    message += "; the other ranks cannot be asked (MPI without MPI_THREAD_MULTIPLE)";
    fatal_error(__FILE__, __LINE__, message);
  }
  std::vector<int> not_arrived;
  std::string details;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const Answer& a = answers[i];
    const bool arrived = a.answered && (!is_collective(op.kind) || a.entered >= static_cast<int64_t>(op.seq));
    if (is_collective(op.kind) && arrived) continue;  // report only the ranks that hold it up
    if (is_collective(op.kind)) not_arrived.push_back(ranks[i]);
    if (!a.answered) {
      details += fmt::format("; {}: no answer (dead, or its process is stopped)", rank_name(e, ranks[i]));
    } else {
      details += fmt::format("; {}: has entered {} collectives on {}, now {}", rank_name(e, ranks[i]), a.entered,
                             e.comm_name, a.state);
    }
  }
  if (is_collective(op.kind)) {
    message += not_arrived.empty()
                   ? "; ranks not arrived: none (every rank is inside it; look for mismatched calls with "
                     "FOLDPAR_COMM_CHECK=1)"
                   : fmt::format("; ranks not arrived: {}", join_ranks(not_arrived));
  }
  const std::vector<Answer> elsewhere(answers.begin() + static_cast<std::ptrdiff_t>(ranks.size()), answers.end());
  fatal_error(__FILE__, __LINE__, message + details + describe_elsewhere(others, elsewhere));
}

std::string MpiWatchdog::describe_elsewhere(const std::vector<int>& others, const std::vector<Answer>& answers) const {
  std::string out;
  for (size_t i = 0; i < others.size(); ++i) {
    const Answer& a = answers[i];
    if (a.answered && !a.purposeful) continue;
    out += fmt::format("; elsewhere, world rank {} on {}: {}", others[i], ctx_.hosts[others[i]],
                       a.answered ? a.state : "no answer (dead, or its process is stopped)");
  }
  return out;
}

}  // namespace foldpar::mpi_detail
