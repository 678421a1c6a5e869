// The watchdog of the MPI backend (internal; includes mpi.h through mpi_internal.h).
//
// The main thread registers every operation when it starts and removes it when it
// completes (a spin lock, a coarse clock and a vector; no MPI call), and marks a
// non-blocking one when it starts waiting for it. A background thread wakes every
// min(100 ms, timeout/4) and
//  - answers status queries from other ranks' watchdogs on its own duplicate of
//    MPI_COMM_WORLD: for a communicator, how many collectives this rank has entered on it,
//    and which operations it has in flight (this needs MPI_THREAD_MULTIPLE);
//  - when the main thread has been waiting for an operation (a blocking call, or wait() on
//    a request) longer than the timeout, asks the other ranks involved (all ranks of the
//    communicator for a collective, the peer and source for point-to-point), and the rest
//    of the job, waits up to a grace period for answers, prints the operation (its purpose
//    first when the caller gave one: CommPurpose), its sequence number, the communicator,
//    the ranks that have not arrived, what every peer is doing and which other ranks wait
//    in an operation with a purpose or do not answer, and aborts the job (MPI_Abort).
// A request started but not yet waited for never expires: a rank that computes while its
// sends drain is not hung, and the ranks that wait for it report it.
// A rank has arrived at collective #s when it has entered at least s collectives on that
// communicator; a rank that does not answer (dead, or its process stopped) is listed as not
// arrived, with "no answer".
#pragma once

#include <time.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_internal.h"

namespace foldpar::mpi_detail {

// steady_clock at the kernel tick's resolution (a few ms) for a fraction of its cost: the
// main thread stamps every operation, and timeouts are seconds.
struct CoarseClock {
  using duration = std::chrono::nanoseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<CoarseClock>;
  static constexpr bool is_steady = true;
  static time_point now() noexcept {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return time_point(duration(static_cast<rep>(ts.tv_sec) * 1000000000 + ts.tv_nsec));
  }
};

// Guards the registry. The main thread takes it twice per operation and the watchdog thread
// briefly per poll, so it is almost never contended, where a spin is cheaper than a mutex.
class SpinLock {
 public:
  void lock() {
    while (flag_.test_and_set(std::memory_order_acquire)) std::this_thread::yield();
  }
  void unlock() { flag_.clear(std::memory_order_release); }

 private:
  std::atomic_flag flag_ = ATOMIC_FLAG_INIT;
};

class MpiWatchdog {
 public:
  // Collective over MPI_COMM_WORLD (duplicates it). `can_query`: MPI runs with
  // MPI_THREAD_MULTIPLE, so the thread may talk to peers; otherwise reports name only this
  // rank's view.
  MpiWatchdog(const MpiContext& ctx, double timeout_s, bool can_query);
  ~MpiWatchdog();  // stops and joins the thread; frees its communicator
  MpiWatchdog(const MpiWatchdog&) = delete;
  MpiWatchdog& operator=(const MpiWatchdog&) = delete;

  // Main thread. `comm` was added under `key` and outlives the operation. Returns a token
  // for end(). `waiting`: the caller blocks in it from the start (a blocking call);
  // otherwise from wait_begins().
  uint64_t begin(const Communicator& comm, uint64_t key, const CommOp& op, bool waiting);
  void wait_begins(uint64_t token);
  void end(uint64_t token);
  // A communicator, under the key its members agree on (same name, members and ordinal).
  // It must have no operation in flight when removed.
  void add_comm(uint64_t key, const Communicator* comm);
  void remove_comm(uint64_t key);

 private:
  using Clock = CoarseClock;
  struct Inflight {
    uint64_t token;
    const Communicator* comm;
    uint64_t key;
    CommOpKind kind;
    uint64_t seq;
    int peer;
    int source;
    CommPurpose purpose;
    Clock::time_point start;
    bool waiting;                      // the main thread blocks in it
    Clock::time_point waiting_since;   // meaningful when waiting
  };
  // What a diagnosis needs of a timed-out operation, copied while the lock is held.
  struct Expired {
    Inflight op;
    std::string what;          // "collective all_gather #17 on communicator tsp (world ranks 0-3) has ..."
    std::string comm_name;
    std::vector<int> world_ranks;
    int rank;
  };
  struct Answer {
    bool answered = false;
    int64_t entered = -1;      // collectives the peer has entered on the communicator
    bool purposeful = false;   // the peer waits in an operation with a purpose
    std::string state;         // what the peer is doing
  };

  void loop();
  void answer_queries();
  std::string describe_self(uint64_t key, int64_t* entered, bool* purposeful);  // registry_ held
  std::string describe_op(const Inflight& op, Clock::time_point now) const;
  Expired snapshot(const Inflight& op, Clock::time_point now) const;  // registry_ held
  [[noreturn]] void diagnose(const Expired& expired);
  std::vector<Answer> query(uint64_t key, const std::vector<int>& world_targets);
  std::string rank_name(const Expired& e, int rank) const;
  // The rest of the job (world ranks `others`, answers in the same order): those that wait
  // in an operation with a purpose or do not answer.
  std::string describe_elsewhere(const std::vector<int>& others, const std::vector<Answer>& answers) const;

  const MpiContext& ctx_;
  const double timeout_s_;
  const bool can_query_;
  MPI_Comm comm_ = MPI_COMM_NULL;

  std::mutex wake_mu_;  // sleep and stop of the thread
  std::condition_variable wake_;
  bool stop_ = false;
  SpinLock registry_;  // guards what follows
  uint64_t next_token_ = 1;
  std::vector<Inflight> inflight_;
  std::map<uint64_t, const Communicator*> comms_;
  std::map<const Communicator*, uint64_t> keys_;
  std::thread thread_;
};

}  // namespace foldpar::mpi_detail
