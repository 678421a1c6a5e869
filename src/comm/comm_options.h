// Settings of a communication runtime that a program chooses once at start-up: checking
// mode and the watchdog. Every field can come from the environment (from_env) or a flag.
// All ranks of a job must use the same settings.
#pragma once

#include "core/status.h"

namespace foldpar {

struct CommOptions {
  // Checking mode. Before every collective, the ranks of the communicator exchange what they
  // are about to call (operation, sequence number, count or counts, dtype, reduction, root)
  // and, if any differ, every rank fails with a message naming the disagreeing ranks. Costs
  // one small blocking all-gather per collective, which also makes a non-blocking collective
  // wait at its start for every rank to start it. Env FOLDPAR_COMM_CHECK=0|1. Default off.
  bool check = false;
  // Watchdog. An operation (collective or point-to-point) that has not completed this many
  // seconds after it started is reported (operation, sequence number, communicator, the
  // ranks that have not arrived and what each peer is doing) and the whole job is aborted.
  // > 0 seconds, or 0 to disable. Env FOLDPAR_COMM_TIMEOUT=<seconds>. Default 300.
  double timeout_s = 300;
  // How the MPI backend reduce-scatters (blocking and not, equal and uneven blocks),
  // all-reduces 1 MiB or more (blocking: the pairwise reduce-scatter, then an all-gather) and
  // reduces 1 MiB or more non-blocking (whole buffers posted to the root, summed there in
  // rank-distance order).
  // kPairwise: each rank posts its N-1 blocks to their owners and N-1 receives at once (on a
  // communicator of its own), then sums what arrived into its block in rank-distance order:
  // the ring's bytes in one round. kLibrary: MPI_(I)Reduce_scatter(_block), the MPI library's
  // own algorithm; Debian's OpenMPI 4.1.4 runs these at 0.06-0.2 GB/s on one host (every
  // algorithm its tuned component offers), against 3-10 GB/s for its all-gather
  // (docs/PERFORMANCE.md, Communication). Env FOLDPAR_REDUCE_SCATTER=pairwise|library.
  // Default kPairwise.
  enum class ReduceScatterAlgorithm { kPairwise, kLibrary };
  ReduceScatterAlgorithm reduce_scatter = ReduceScatterAlgorithm::kPairwise;

  // The defaults, overridden by FOLDPAR_COMM_CHECK, FOLDPAR_COMM_TIMEOUT and
  // FOLDPAR_REDUCE_SCATTER when set.
  // Malformed values are the user's mistake: invalid_argument naming the variable and value.
  static Result<CommOptions> from_env();
};

}  // namespace foldpar
