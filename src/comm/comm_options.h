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

  // The defaults, overridden by FOLDPAR_COMM_CHECK and FOLDPAR_COMM_TIMEOUT when set.
  // Malformed values are the user's mistake: invalid_argument naming the variable and value.
  static Result<CommOptions> from_env();
};

}  // namespace foldpar
