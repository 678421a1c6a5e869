// Internal to the MPI backend (the comm/mpi_*.cc files): the MPI check macro, dtype and
// reduction mappings, and the state a runtime shares with its communicators and watchdog.
// It includes mpi.h, so no public header may include it.
#pragma once

// The C API only: OpenMPI's and MPICH's deprecated C++ bindings would need libmpi_cxx.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm_options.h"
#include "comm/communicator.h"
#include "tensor/dtype.h"

// Runs an MPI call; any error code is a library failure: it prints the call, file:line,
// MPI's error text, rank and host, and aborts the whole job (MPI_Abort via the fatal handler).
#define FP_MPI_CHECK(call)                                                         \
  do {                                                                             \
    const int fp_mpi_rc_ = (call);                                                 \
    if (fp_mpi_rc_ != MPI_SUCCESS) [[unlikely]]                                    \
      ::foldpar::mpi_detail::mpi_call_failed(__FILE__, __LINE__, #call, fp_mpi_rc_); \
  } while (0)

namespace foldpar::mpi_detail {

[[noreturn]] void mpi_call_failed(const char* file, int line, const char* call, int code);

// How a dtype travels. bf16 moves as raw 16-bit words; its reductions are done in f32.
MPI_Datatype mpi_type(DType dtype);
MPI_Op mpi_op(ReduceOp op);

class MpiWatchdog;

// Shared by an MpiRuntime, every communicator made from it and its watchdog; lives as long
// as the runtime. Only the main thread writes it after start-up, except the atomics.
struct MpiContext {
  int world_rank = 0;
  int world_size = 1;
  std::vector<std::string> hosts;          // by world rank
  std::atomic<bool> check{false};          // checking mode (CommOptions::check)
  bool pairwise_reduce_scatter = true;     // CommOptions::reduce_scatter == kPairwise
  std::unique_ptr<MpiWatchdog> watchdog;   // null when the timeout is 0
  std::atomic<int> live_comms{0};          // communicators not yet destroyed
  std::map<std::string, int> comm_ordinals;  // communicators created per (name, members)
};

// Wraps `comm` (a communicator this process owns and frees, or MPI_COMM_WORLD, which it
// does not) as a Communicator named `name`. Collective over `comm`.
std::unique_ptr<Communicator> make_mpi_communicator(MpiContext* ctx, MPI_Comm comm, std::string name);

}  // namespace foldpar::mpi_detail
