// The host-staged device communicator, for ranks that share one GPU (NCCL refuses two
// ranks on a device): each operation waits for the compute stream, copies device-only
// buffers into host memory, runs on the host communicator (MPI), and copies results back.
// Unified memory is passed to MPI as it is (the driver migrates the pages). Non-blocking
// forms complete before they return: no overlap on this path (docs/GPU.md).
#include <cuda_runtime.h>

#include <vector>

#include "comm/nccl/device_communicator.h"
#include "comm/nccl/staging.h"
#include "cuda/cuda_check.h"

namespace foldpar {
namespace {

bool device_only(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice;
}

class HostStagedCommunicator final : public Communicator {
 public:
  HostStagedCommunicator(Communicator& host, std::unique_ptr<Communicator> owned_host, const DeviceCommOptions& options)
      : Communicator(host.rank(), host.size(), host.name(), host.world_ranks()),
        host_(host),
        owned_host_(std::move(owned_host)),
        options_(options) {}

  std::unique_ptr<Communicator> split(int color, int key, std::string name) override {
    std::unique_ptr<Communicator> part = host_.split(color, key, std::move(name));
    Communicator& ref = *part;
    return std::make_unique<HostStagedCommunicator>(ref, std::move(part), options_);
  }

 protected:
  Status supports(const CommOp&) const override { return Status::ok_status(); }

  Status run_validated(const CommOp& op) override {
    FP_CUDA_CHECK(cudaSetDevice(options_.device));
    auto* compute = static_cast<cudaStream_t>(op.stream.native != nullptr ? op.stream.native : options_.compute_stream);
    if (compute != nullptr) {
      FP_CUDA_CHECK(cudaStreamSynchronize(compute));
    } else {
      FP_CUDA_CHECK(cudaDeviceSynchronize());
    }
    CommOp host_op = op;
    host_op.stream = {};
    std::vector<std::vector<char>> buffers;
    const nccl_detail::Stager stager{
        device_only,
        [&](size_t bytes) { return buffers.emplace_back(bytes).data(); },
        [](void* dst, const void* src, size_t bytes) { FP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault)); }};
    const nccl_detail::StagedRange back = nccl_detail::stage(host_op, rank(), size(), stager);
    Status status = host_.run(host_op);
    if (status.ok() && back.bytes > 0) FP_CUDA_CHECK(cudaMemcpy(back.user, back.staged, back.bytes, cudaMemcpyDefault));
    return status;
  }

  CommRequest start_validated(const CommOp& op) override {
    Status status = run_validated(op);
    return status.ok() ? CommRequest() : CommRequest::failed(std::move(status));
  }

 private:
  Communicator& host_;
  std::unique_ptr<Communicator> owned_host_;
  DeviceCommOptions options_;
};

}  // namespace

std::unique_ptr<Communicator> make_host_staged_communicator(Communicator& host, const DeviceCommOptions& options) {
  return std::make_unique<HostStagedCommunicator>(host, nullptr, options);
}

}  // namespace foldpar
