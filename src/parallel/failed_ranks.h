// Every rank's verdict on a phase that may fail on some ranks only (loading weights, opening
// a device, a non-finite gradient, writing a checkpoint, preparing the default corpus):
// which ranks failed and the first one's error class, known to all, so that every rank
// leaves the phase the same way (and the job exits with one code) and none waits in a later
// collective for one that gave up. Each caller words its own error; the agreement is this
// one call.
#pragma once

#include <vector>

#include "comm/communicator.h"
#include "core/status.h"

namespace foldpar {

struct PhaseVerdict {
  std::vector<int> failed;                // ranks whose status was not ok, ascending
  StatusCode first_code = StatusCode::kOk;  // the code of failed.front(), kOk when none
  bool ok() const { return failed.empty(); }
};

// Collective over comm: one all_gather of one i32 per rank (a library failure aborts, as
// every collective's does). The same verdict on every rank.
PhaseVerdict agree_on_phase(Communicator& comm, const Status& mine);

// The ranks of `comm` whose `failed` is true, ascending, the same list on every rank.
// Collective over comm, as agree_on_phase.
std::vector<int> failed_ranks(Communicator& comm, bool failed);

}  // namespace foldpar
