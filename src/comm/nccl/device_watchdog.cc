// DeviceWatchdog (device_watchdog.h): the registry of enqueued operations and its polling.
#include "comm/nccl/device_watchdog.h"

#include <algorithm>

#include <fmt/format.h>

namespace foldpar::nccl_detail {

DeviceWatchdog::DeviceWatchdog(std::string comm_name, int rank, int size, double timeout_s,
                               DeviceWatchdogHooks hooks, bool thread)
    : comm_name_(std::move(comm_name)), rank_(rank), size_(size), timeout_s_(timeout_s), hooks_(std::move(hooks)) {
  if (thread) thread_ = std::thread([this] { run(); });
}

DeviceWatchdog::~DeviceWatchdog() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t DeviceWatchdog::begin(const CommOp& op, std::function<bool()> completed, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t token = next_token_++;
  entries_.push_back({token, op.kind, op.seq, op.peer, op.source, op.root, op.purpose, now, std::move(completed)});
  return token;
}

Status DeviceWatchdog::wait_host(const std::function<bool()>& completed) {
  // Spin briefly (most host waits are for small transfers), then sleep in growing steps up to
  // 1 ms: a host wait costs a core only while it is short.
  auto pause = std::chrono::microseconds(0);
  while (!completed()) {
    if (failed()) {
      std::lock_guard<std::mutex> lock(mu_);
      return Status(StatusCode::kInternal, report_);
    }
    if (pause.count() == 0) {
      std::this_thread::yield();
      pause = std::chrono::microseconds(1);
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::microseconds(1000));
    }
  }
  return Status::ok_status();
}

size_t DeviceWatchdog::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

std::string DeviceWatchdog::describe(const Entry& e, Clock::time_point now) const {
  const double waited = std::chrono::duration<double>(now - e.start).count();
  std::string peers;
  switch (e.kind) {
    case CommOpKind::kSend: peers = fmt::format(" to rank {}", e.peer); break;
    case CommOpKind::kRecv: peers = fmt::format(" from rank {}", e.source); break;
    case CommOpKind::kSendRecv: peers = fmt::format(" to rank {} and from rank {}", e.peer, e.source); break;
    case CommOpKind::kBroadcast:
    case CommOpKind::kReduce: peers = fmt::format(" (root {})", e.root); break;
    default: break;
  }
  std::string what = fmt::format("{} #{}{} on communicator '{}' (rank {} of {})", comm_op_name(e.kind), e.seq, peers,
                                 comm_name_, rank_, size_);
  if (e.purpose.format != nullptr) what = fmt::format("{}: {}", describe_purpose(e.purpose), what);
  return fmt::format("{}, enqueued {:.1f} s ago", what, waited);
}

std::string DeviceWatchdog::poll(Clock::time_point now) {
  std::string report;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed()) return report_;
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [](const Entry& e) { return e.completed(); }),
                   entries_.end());
    const std::string async = hooks_.async_error ? hooks_.async_error() : std::string();
    if (!async.empty()) {
      report = fmt::format("NCCL watchdog: communicator '{}' (rank {} of {}) failed: {}", comm_name_, rank_, size_,
                           async);
      if (!entries_.empty()) report += fmt::format("; pending: {}", describe(entries_.front(), now));
    } else if (timeout_s_ > 0 && !entries_.empty()) {
      // The oldest pending operation: entries are in enqueue order.
      const Entry& oldest = entries_.front();
      if (std::chrono::duration<double>(now - oldest.start).count() > timeout_s_)
        report = fmt::format("NCCL watchdog: {} has not completed after the {:g} s timeout (FOLDPAR_COMM_TIMEOUT); "
                             "a peer of this communicator is not taking part: aborting the job",
                             describe(oldest, now), timeout_s_);
    }
    if (report.empty()) return report;
    report_ = report;
    failed_.store(true, std::memory_order_release);
  }
  if (hooks_.abort) hooks_.abort();
  if (hooks_.fail) hooks_.fail(report);
  return report;
}

void DeviceWatchdog::run() {
  const auto period = std::chrono::duration<double>(timeout_s_ > 0 ? std::min(0.1, timeout_s_ / 4) : 0.1);
  std::unique_lock<std::mutex> lock(stop_mu_);
  while (!stop_) {
    if (stop_cv_.wait_for(lock, period, [this] { return stop_; })) break;
    lock.unlock();
    const bool done = !poll().empty();
    lock.lock();
    if (done) break;
  }
}

}  // namespace foldpar::nccl_detail
