// Every rank's verdict on a phase that may fail on some ranks only (loading weights, opening
// a device, a non-finite gradient, writing a checkpoint): which ranks failed, known to all,
// so that every rank leaves the phase the same way and none waits in a later collective for
// one that gave up. Each caller words its own error; the agreement is this one call.
#pragma once

#include <vector>

#include "comm/communicator.h"

namespace foldpar {

// The ranks of `comm` whose `failed` is true, ascending, the same list on every rank.
// Collective over comm: one all_gather of one i32 per rank (a library failure aborts, as
// every collective's does).
std::vector<int> failed_ranks(Communicator& comm, bool failed);

}  // namespace foldpar
