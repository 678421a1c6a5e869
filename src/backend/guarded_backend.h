// The guarded backend: a Backend decorator for the device-memory stand-in (issue 20;
// tensor/guarded_allocator.h). Each op opens the guard, runs on the inner backend and closes
// it again, so guarded tensor memory is accessible exactly while a Backend op runs: a test
// that runs a step with tensors from a guarded tracker and this backend fails (SIGSEGV) at the
// first host touch of tensor data outside an op, as a step on device memory would. It changes
// no result. Every op of backend.h must be forwarded here (a new op that is not would run the
// inner op with the guard closed and fault, which is loud, not silent).
#pragma once

#include <memory>

#include "backend/backend.h"
#include "tensor/guarded_allocator.h"

namespace foldpar {

// `inner` and `guard` are borrowed and must outlive the returned backend.
std::unique_ptr<Backend> make_guarded_backend(Backend& inner, GuardedAllocator& guard);

}  // namespace foldpar
