// --device cuda: the CUDA backend and the device communicators for one process. Compiled
// only with FOLDPAR_WITH_CUDA (tools/CMakeLists.txt); tools/device.h is its interface.
#include <utility>

#include "backend/cuda/cuda_backend.h"
#include "comm/comm_options.h"
#include "comm/nccl/device_communicator.h"
#include "device.h"
#include "tensor/memory_tracker.h"

namespace foldpar::cli {

Result<Device> open_cuda_device(int local_rank) {
  std::string why;
  const int count = cuda_device_count(&why);
  if (count <= 0) return not_found("--device cuda: no usable GPU ({})", why);
  // Before any tensor exists: every block of the process from now on is device memory, and
  // host code reaches it only through Backend ops and Tensor's explicit copies (the guarded
  // stand-in, tests/parallel/guarded_memory_test.cc, proves that of training, checkpoints
  // and generation). Ops return once enqueued; the host waits where it reads.
  CudaBackendOptions options;
  options.device = local_rank % count;
  use_cuda_memory(MemoryTracker::process(), CudaMemory::kDevice);
  std::unique_ptr<CudaBackend> cuda = make_cuda_backend(options);
  FP_ASSIGN_OR_RETURN(const CommOptions comm_options, CommOptions::from_env());
  const DeviceCommOptions comm{
      .device = options.device, .compute_stream = cuda->stream(), .timeout_s = comm_options.timeout_s};
  Device device;
  device.axis_comm = [comm](Communicator& host) { return make_device_communicator(host, comm); };
  device.backend = std::move(cuda);
  return device;
}

}  // namespace foldpar::cli
