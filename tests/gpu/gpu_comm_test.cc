// The device communicators under mpirun: every collective and a ring step on unified
// memory, on device-only memory (cudaMalloc) and on host stack memory, against the values
// the contract prescribes. At 1 or 2 ranks on one GPU this exercises the host-staged
// communicator; the NCCL path runs where each rank has its own GPU (make_device_communicator
// picks it). Skipped where no GPU is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "comm/nccl/device_communicator.h"
#include "gpu_test_util.h"
#include "mpi_test_main.h"

namespace foldpar {
namespace {

// Device-only memory of n floats, copied to and from host vectors.
class DeviceFloats {
 public:
  explicit DeviceFloats(size_t n) : n_(n) { EXPECT_EQ(cudaMalloc(&p_, n * sizeof(float)), cudaSuccess); }
  ~DeviceFloats() { (void)cudaFree(p_); }
  float* get() { return p_; }
  void set(const std::vector<float>& v) { (void)cudaMemcpy(p_, v.data(), n_ * sizeof(float), cudaMemcpyDefault); }
  std::vector<float> get_host() const {
    std::vector<float> v(n_);
    (void)cudaMemcpy(v.data(), p_, n_ * sizeof(float), cudaMemcpyDefault);
    return v;
  }

 private:
  float* p_ = nullptr;
  size_t n_;
};

class GpuComm : public ::testing::Test {
 protected:
  void SetUp() override {
    FP_REQUIRE_GPU();
    world_ = &test::mpi().world();
    comm_ = make_device_communicator(*world_, {.device = 0, .compute_stream = nullptr});
  }
  Communicator* world_ = nullptr;
  std::unique_ptr<Communicator> comm_;
};

TEST_F(GpuComm, AllReduceOnDeviceUnifiedAndHostMemory) {
  const int n = comm_->size(), r = comm_->rank();
  const size_t count = 1000;
  // Device-only memory.
  DeviceFloats dev(count);
  std::vector<float> mine(count);
  for (size_t i = 0; i < count; ++i) mine[i] = static_cast<float>(r + 1) * static_cast<float>(i);
  dev.set(mine);
  ASSERT_TRUE(comm_->all_reduce(dev.get(), dev.get(), count, DType::kF32, ReduceOp::kSum).ok());
  const std::vector<float> got = dev.get_host();
  const float ranks_sum = static_cast<float>(n * (n + 1) / 2);
  for (size_t i = 0; i < count; ++i) ASSERT_EQ(got[i], ranks_sum * static_cast<float>(i)) << i;
  // Unified memory (a tensor).
  Tensor t = Tensor::empty({static_cast<int64_t>(count)}, DType::kF32, MemCategory::kComm);
  std::copy(mine.begin(), mine.end(), t.data<float>());
  ASSERT_TRUE(comm_->all_reduce(t.raw_data(), t.raw_data(), count, DType::kF32, ReduceOp::kMax).ok());
  for (size_t i = 0; i < count; ++i) ASSERT_EQ(t.data<float>()[i], static_cast<float>(n) * static_cast<float>(i)) << i;
  // A host double on the stack (how losses are summed).
  double loss = 0.5 + r;
  ASSERT_TRUE(comm_->all_reduce(&loss, &loss, 1, DType::kF64, ReduceOp::kSum).ok());
  EXPECT_EQ(loss, 0.5 * n + n * (n - 1) / 2.0);
}

TEST_F(GpuComm, BroadcastAllGatherReduceScatterAndRing) {
  const int n = comm_->size(), r = comm_->rank();
  const size_t count = 257;
  DeviceFloats block(count), gathered(count * n), full(count * n), part(count);
  block.set(std::vector<float>(count, static_cast<float>(r)));
  CommRequest req = comm_->iall_gather(block.get(), gathered.get(), count, DType::kF32);
  ASSERT_TRUE(req.wait().ok());
  const std::vector<float> g = gathered.get_host();
  for (int q = 0; q < n; ++q) ASSERT_EQ(g[q * count + 3], static_cast<float>(q)) << q;
  full.set(std::vector<float>(count * n, 1.0f));
  ASSERT_TRUE(comm_->reduce_scatter(full.get(), part.get(), count, DType::kF32, ReduceOp::kSum).ok());
  EXPECT_EQ(part.get_host()[5], static_cast<float>(n));
  DeviceFloats root(count);
  root.set(std::vector<float>(count, static_cast<float>(r + 10)));
  ASSERT_TRUE(comm_->broadcast(root.get(), count, DType::kF32, 0).ok());
  EXPECT_EQ(root.get_host()[count - 1], 10.0f);
  // One forward ring step.
  DeviceFloats next(count);
  ASSERT_TRUE(comm_->send_recv(block.get(), next.get(), count, DType::kF32, (r + 1) % n, (r + n - 1) % n).ok());
  EXPECT_EQ(next.get_host()[0], static_cast<float>((r + n - 1) % n));
}

}  // namespace
}  // namespace foldpar
