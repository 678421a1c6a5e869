// The watchdog of the NCCL backend (internal to comm/nccl; no CUDA or NCCL type here, so
// its logic is tested without a GPU: tests/gpu/device_watchdog_test.cc).
//
// NCCL reports a dead or unreachable peer only asynchronously (ncclCommGetAsyncError), and a
// collective that a peer never joins never completes: the host then blocks for ever in the
// next synchronization (a loss read, a checkpoint), wherever that is. So the communicator
// registers every operation it enqueues, with a completion query (cudaEventQuery of the
// event recorded after it), and a background thread wakes every min(100 ms, timeout / 4):
//  - operations that completed are dropped;
//  - an asynchronous error on the communicator is reported at once;
//  - the oldest operation still pending `timeout_s` after it was enqueued is reported
//    (its purpose first when the caller gave one: CommPurpose, then the operation, its
//    sequence number, the communicator and this rank's place in it).
// On a report the thread aborts the communicator (ncclCommAbort, which also frees a host
// thread blocked on its kernels) and fails the process with the report (fatal_error: one
// line, then the job ends), as the MPI watchdog does. Unlike the MPI watchdog, an operation
// expires from when it was enqueued, not from when the host waits for it: the host rarely
// waits for an NCCL operation (the compute stream does), and a GPU-side wait is still a
// wait. Host waits (wait() on a request whose result the host reads) poll the query instead
// of blocking in cudaEventSynchronize, so they end when the watchdog fails.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm_op.h"
#include "core/status.h"

namespace foldpar::nccl_detail {

// What the watchdog needs from the transport.
struct DeviceWatchdogHooks {
  // The communicator's asynchronous error (ncclCommGetAsyncError): "" while there is none.
  std::function<std::string()> async_error;
  // Stops the communicator's pending operations (ncclCommAbort). Called at most once.
  std::function<void()> abort;
  // Ends the process with the report (fatal_error). Tests record it instead.
  std::function<void(const std::string& report)> fail;
};

class DeviceWatchdog {
 public:
  using Clock = std::chrono::steady_clock;

  // `timeout_s` <= 0 disables the timeout (asynchronous errors are still reported).
  // `thread`: poll from a background thread (false: the caller calls poll, as tests do).
  DeviceWatchdog(std::string comm_name, int rank, int size, double timeout_s, DeviceWatchdogHooks hooks,
                 bool thread = true);
  ~DeviceWatchdog();  // stops and joins the thread
  DeviceWatchdog(const DeviceWatchdog&) = delete;
  DeviceWatchdog& operator=(const DeviceWatchdog&) = delete;

  // Registers an operation just enqueued; `completed` must stay callable (from any thread)
  // until it returns true or the watchdog is destroyed. Returns its token.
  uint64_t begin(const CommOp& op, std::function<bool()> completed, Clock::time_point now = Clock::now());
  // Host wait: returns once `completed` returns true, or an error (the report) once the
  // watchdog has failed; never blocks in the driver.
  Status wait_host(const std::function<bool()>& completed);

  // One round: drops completed operations; on an asynchronous error or an expired operation
  // aborts the communicator, calls the fail hook once and returns the report ("" when all
  // is well). Thread-safe.
  std::string poll(Clock::time_point now = Clock::now());

  bool failed() const { return failed_.load(std::memory_order_acquire); }
  size_t in_flight() const;

 private:
  struct Entry {
    uint64_t token;
    CommOpKind kind;
    uint64_t seq;
    int peer, source, root;
    CommPurpose purpose;
    Clock::time_point start;
    std::function<bool()> completed;
  };
  std::string describe(const Entry& e, Clock::time_point now) const;
  void run();

  std::string comm_name_;
  int rank_, size_;
  double timeout_s_;
  DeviceWatchdogHooks hooks_;
  mutable std::mutex mu_;
  std::vector<Entry> entries_;
  uint64_t next_token_ = 1;
  std::atomic<bool> failed_{false};
  std::string report_;  // under mu_, once failed
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace foldpar::nccl_detail
