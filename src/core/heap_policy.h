// How the process's heap hands back large blocks: kept and reused instead of returned to
// the system on free, so that a large temporary allocated per call (the MPI library's own,
// a tensor) is not faulted in again on every call.
//
// Why: glibc serves blocks of 32 MiB and more (its largest mmap threshold on 64-bit) with a
// fresh mmap and unmaps them on free, and on the VMs this project measures on a fresh page
// costs 1.4-3 ms per MiB (docs/PERFORMANCE.md "Fresh pages"). Open MPI's non-blocking
// all-reduce copies an in-place buffer into a temporary of the buffer's size, so tp=2's
// 32 MiB activation all-reduces at S = 16384 faulted about 32 MiB each: 214,000 faults and
// 2.9 s of a 31.7 s step (docs/PERFORMANCE.md "Large blocks kept").
#pragma once

namespace foldpar {

// Asks glibc to serve every block from its heap (no mmap per block) and to keep freed memory
// at the top of the heap (trim only above INT_MAX bytes). Process-wide; call once at start,
// before the first large allocation. Returns false where the allocator ignores the request
// (AddressSanitizer's, another malloc): nothing changes then.
bool keep_freed_heap_memory();

}  // namespace foldpar
