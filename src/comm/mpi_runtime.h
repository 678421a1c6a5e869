// MpiRuntime: MPI for one process of a job, and its world communicator. The MPI backend of
// Communicator lives behind it (comm/mpi_communicator.cc); no MPI type appears here, so code
// that talks through Communicator builds the same against the NCCL backend later.
//
// What it sets up, once, on the thread that runs main():
//  - MPI_Init_thread with MPI_THREAD_MULTIPLE when the watchdog is on (its thread answers
//    and sends status queries while the main thread sits in a collective), otherwise
//    MPI_THREAD_FUNNELED.
//  - MPI errors return to foldpar (MPI_ERRORS_RETURN): a failed MPI call prints the call,
//    file:line, the MPI error text, rank and host, then aborts the whole job.
//  - The fatal handler of core/check.h becomes MPI_Abort(MPI_COMM_WORLD), so any FP_CHECK
//    failure on any rank ends every rank with a non-zero exit; the process identity
//    becomes "rank R on HOST".
//  - The watchdog thread (CommOptions::timeout_s) and checking mode (CommOptions::check).
// A rank that dies (SIGKILL) is noticed by mpirun, which kills the rest of the job; where a
// launcher does not, the peers' watchdogs end the job after the timeout.
#pragma once

#include <memory>
#include <string>

#include "comm/comm_options.h"
#include "comm/communicator.h"

namespace foldpar {

namespace mpi_detail {
struct MpiContext;
}

class MpiRuntime {
 public:
  // One per process, constructed in main() before any communication (argc/argv may be null).
  // Initializing MPI twice in a process is a bug (FP_CHECK).
  MpiRuntime(int* argc, char*** argv, const CommOptions& options);
  // Stops the watchdog and finalizes MPI. Every communicator split from world() must have
  // been destroyed and every request completed before (FP_CHECK).
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  // MPI_COMM_WORLD as a Communicator named "world".
  Communicator& world() { return *world_; }
  int world_rank() const;
  int world_size() const;
  const std::string& host() const;
  // This rank's index among the ranks on its host (those with the same processor name,
  // gathered at start-up), in world-rank order: what picks a GPU per rank. No communication.
  int local_rank() const;
  const CommOptions& options() const { return options_; }
  bool watchdog_enabled() const;

  // Turns checking mode on or off for every communicator of this runtime. Every rank must
  // switch at the same point of its program (between the same two collectives).
  void set_check(bool on);

 private:
  CommOptions options_;
  std::unique_ptr<mpi_detail::MpiContext> ctx_;
  std::unique_ptr<Communicator> world_;
};

}  // namespace foldpar
