// --device: parsing, and the CPU / CUDA dispatch. The only #ifdef FOLDPAR_HAVE_CUDA of the
// program's logic is here; CUDA itself is in tools/cuda_device.cc.
#include "device.h"

#include <fmt/ranges.h>

#include <cstdint>
#include <vector>

#include "core/check.h"
#include "parallel/failed_ranks.h"

namespace foldpar::cli {

Result<DeviceKind> parse_device(const std::string& name) {
  if (name == "cpu") return DeviceKind::kCpu;
  if (name != "cuda") return invalid_argument("--device '{}' is unknown; choose cpu or cuda", name);
#ifdef FOLDPAR_HAVE_CUDA
  return DeviceKind::kCuda;
#else
  return unimplemented(
      "--device cuda: this foldpar was built without CUDA; configure with -DFOLDPAR_WITH_CUDA=ON "
      "(scripts/build-cuda.sh builds foldpar with CUDA into build-cuda/)");
#endif
}

Result<Device> open_device(DeviceKind kind, int local_rank) {
  if (kind == DeviceKind::kCpu) return Device{};
#ifdef FOLDPAR_HAVE_CUDA
  return open_cuda_device(local_rank);
#else
  (void)local_rank;
  return parse_device("cuda").status();  // unreachable after parse_device; the same message
#endif
}

Result<Device> open_job_device(DeviceKind kind, MpiRuntime& mpi) {
  if (kind == DeviceKind::kCpu) return Device{};  // nothing can fail: no collective
  Result<Device> device = open_device(kind, mpi.local_rank());
  Communicator& world = mpi.world();
  const PhaseVerdict v = agree_on_phase(world, device.status());
  if (!device.ok()) return device.status();
  if (!v.ok()) return not_found("--device cuda: no usable GPU on rank(s) {} of the job", fmt::join(v.failed, ", "));
  return device;
}

}  // namespace foldpar::cli
