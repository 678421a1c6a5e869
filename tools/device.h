// --device cpu|cuda: where `foldpar train`, `bench` and `generate` run. The libraries take a
// borrowed Backend and an AxisCommFactory (TrainOptions, GenerateOptions, StepBenchOptions)
// and never see CUDA; this is where the program builds them. The CUDA half
// (tools/cuda_device.cc) is compiled only in builds configured with -DFOLDPAR_WITH_CUDA=ON
// (compile definition FOLDPAR_HAVE_CUDA); elsewhere asking for cuda is an error naming the fix.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "comm/mesh.h"
#include "comm/mpi_runtime.h"
#include "core/status.h"

namespace foldpar::cli {

enum class DeviceKind { kCpu, kCuda };

// "cpu" or "cuda". Fails naming an unknown device and the choices, and, for cuda in a build
// without CUDA, naming the fix. Touches no device.
Result<DeviceKind> parse_device(const std::string& name);

// What a subcommand runs on. On the CPU both are null: the library defaults (the fast CPU
// backend, MPI communicators).
struct Device {
  std::unique_ptr<Backend> backend;
  // Wraps each mesh axis's MPI communicator in a device communicator (NCCL, or host staging
  // for ranks sharing a GPU) ordered after `backend`'s stream. Communicators it makes must be
  // destroyed before `backend` (a Mesh built inside the subcommand is).
  AxisCommFactory axis_comm;
};

// Start-up of one process on `kind`; call before the first Tensor is allocated. On cuda:
// GPU (local_rank % visible GPUs), CUDA device memory under MemoryTracker::process(), a
// CUDA backend whose ops return once enqueued (the host waits where it reads: copy_to_host
// and the scalar ops) and the device communicator factory. Fails, with the
// driver's reason, when no GPU is usable.
Result<Device> open_device(DeviceKind kind, int local_rank);

// open_device on every rank of a job (on cuda, collective over mpi.world()): the local rank
// comes from the host names MPI gathered; if any rank fails, every rank returns an error
// (the failing ones their own), so no rank waits for a peer that has left.
Result<Device> open_job_device(DeviceKind kind, MpiRuntime& mpi);

#ifdef FOLDPAR_HAVE_CUDA
Result<Device> open_cuda_device(int local_rank);  // tools/cuda_device.cc
#endif

}  // namespace foldpar::cli
