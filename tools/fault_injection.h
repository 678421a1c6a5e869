// The fault tests' switches, read by the program only: the libraries take injected hooks
// (CheckpointHooks) and never read the environment for them. Used by tests/e2e/train_files.sh.
//   FOLDPAR_FAULT_KILL_CHECKPOINT=<step>: the last rank SIGKILLs itself right after writing its
//   file of that step's checkpoint, before the checkpoint is published.
#pragma once

#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "checkpoint/checkpoint.h"

namespace foldpar::cli {

inline CheckpointHooks checkpoint_hooks_from_env() {
  CheckpointHooks hooks;
  const char* env = std::getenv("FOLDPAR_FAULT_KILL_CHECKPOINT");
  if (env == nullptr) return hooks;
  const long long kill_step = std::atoll(env);
  hooks.after_rank_file = [kill_step](int64_t step, int rank, int world_size) {
    if (step == kill_step && rank == world_size - 1) {
      std::fprintf(stderr, "foldpar: fault injection: rank %d kills itself while writing checkpoint %lld\n", rank,
                   static_cast<long long>(step));
      std::fflush(stderr);
      std::raise(SIGKILL);
    }
    return Status();
  };
  return hooks;
}

}  // namespace foldpar::cli
