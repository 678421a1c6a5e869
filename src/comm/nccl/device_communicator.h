// Communicators for buffers that live on a GPU (CUDA unified or device memory), behind the
// same Communicator interface as the MPI backend:
//  - NCCL (one rank per GPU): the ncclUniqueId travels over a host communicator; transfers
//    run on the communicator's own transfer stream, ordered after the compute stream by an
//    event, so a non-blocking collective overlaps with the kernels that follow it.
//  - Host-staged (several ranks sharing one GPU, which NCCL refuses): the host
//    communicator (MPI) carries the bytes; device-only buffers are copied through host
//    memory, unified memory is read in place.
// make_device_communicator picks between them. No CUDA or NCCL type appears here.
//
// Semantics on top of comm/communicator.h: a blocking call returns when its result is in
// memory (the host may read it); a non-blocking call's wait() likewise. Buffers that the
// GPU cannot address (stack or heap memory of the host) are staged through device memory
// by the NCCL backend, so a caller may all-reduce a host double. NCCL reduces bf16 in bf16
// (each hop rounds), unlike the MPI backend's widen-reduce-round-once (docs/GPU.md).
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace foldpar {

struct DeviceCommOptions {
  int device = 0;                  // this rank's CUDA device ordinal
  void* compute_stream = nullptr;  // cudaStream_t of the compute kernels (CudaBackend::stream()); null: the
                                   // caller orders transfers after compute itself (e.g. sync_each_op)
  // NCCL's watchdog (device_watchdog.h): an operation still pending this many seconds after
  // it was enqueued ends the job with a report; <= 0: only asynchronous errors do.
  // CommOptions::timeout_s (FOLDPAR_COMM_TIMEOUT) in the program.
  double timeout_s = 300;
};

// Collective over `host`. `host` must outlive the result (communicators split from the
// result own their own split host communicators).
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& host, const DeviceCommOptions& options);
std::unique_ptr<Communicator> make_host_staged_communicator(Communicator& host, const DeviceCommOptions& options);

// Collective over `host`: NCCL when the members' devices are pairwise distinct (compared by
// device UUID), host-staged otherwise.
std::unique_ptr<Communicator> make_device_communicator(Communicator& host, const DeviceCommOptions& options);

}  // namespace foldpar
