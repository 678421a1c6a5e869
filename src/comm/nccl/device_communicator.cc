// make_device_communicator: NCCL when every member has its own GPU, host staging when some
// share one. Members compare device UUIDs, gathered over the host communicator.
#include <cuda_runtime.h>

#include <array>
#include <cstring>
#include <set>
#include <vector>

#include "comm/nccl/device_communicator.h"
#include "cuda/cuda_check.h"

namespace foldpar {

std::unique_ptr<Communicator> make_device_communicator(Communicator& host, const DeviceCommOptions& options) {
  cudaDeviceProp prop{};
  FP_CUDA_CHECK(cudaGetDeviceProperties(&prop, options.device));
  std::array<int32_t, 4> uuid{};
  static_assert(sizeof(prop.uuid) == sizeof(uuid));
  std::memcpy(uuid.data(), &prop.uuid, sizeof(uuid));
  std::vector<int32_t> all(uuid.size() * static_cast<size_t>(host.size()));
  FP_CHECK_OK(host.all_gather(uuid.data(), all.data(), uuid.size(), DType::kI32));
  std::set<std::vector<int32_t>> distinct;
  for (int r = 0; r < host.size(); ++r) distinct.emplace(all.begin() + r * 4, all.begin() + (r + 1) * 4);
  // Every member sees the same gathered list, so all pick the same backend.
  if (static_cast<int>(distinct.size()) == host.size()) return make_nccl_communicator(host, options);
  return make_host_staged_communicator(host, options);
}

}  // namespace foldpar
