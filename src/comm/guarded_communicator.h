// The guarded communicator: the device-memory stand-in's communicator (issue 20;
// tensor/guarded_allocator.h). It runs every operation on a host communicator (MPI) with the
// guard open, as a device communicator (NCCL) reads device buffers that host code may not:
// blocking operations open it for their duration, non-blocking ones from their start until
// wait() or test() sees them complete. Counting and validation are the base class's, on
// this communicator; the host communicator counts the same operations again on its own.
// Wrap each axis of a mesh with it through an AxisCommFactory (comm/mesh.h).
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "tensor/guarded_allocator.h"

namespace foldpar {

// `host` and `guard` are borrowed; `owned_host` (may be null) is kept alive with the result.
std::unique_ptr<Communicator> make_guarded_communicator(Communicator& host, std::unique_ptr<Communicator> owned_host,
                                                        GuardedAllocator& guard);

}  // namespace foldpar
