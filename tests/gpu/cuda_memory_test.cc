// The BlockAllocator hook of MemoryTracker, which the CUDA build uses for its memory: with a
// counting fake allocator (runs everywhere) the counters stay exact and blocks go back to
// the allocator they came from; on a GPU, pinned memory is written by a kernel and read on
// the host, and device memory crosses only through the explicit copies, reports a refused
// block with the CUDA reason, and its pool reuses freed blocks.
#include <gtest/gtest.h>

#include <cstdlib>

#include "gpu_test_util.h"
#include "tensor/tensor.h"

namespace foldpar {
namespace {

class CountingAllocator final : public BlockAllocator {
 public:
  void* allocate(size_t bytes) override {
    ++allocations;
    return std::aligned_alloc(MemoryTracker::kAlignment, bytes);
  }
  void release(void* ptr, size_t) override {
    ++releases;
    std::free(ptr);
  }
  int allocations = 0, releases = 0;
};

TEST(BlockAllocatorHook, CountersStayExactAndBlocksGoBack) {
  CountingAllocator fake;
  {
    MemoryTracker tracker;
    tracker.set_block_allocator(&fake);
    {
      Tensor small = Tensor::empty({10}, DType::kF32, MemCategory::kActivations, tracker);
      Tensor large = Tensor::empty({100000}, DType::kBF16, MemCategory::kParameters, tracker);
      const MemoryStats s = tracker.stats();
      EXPECT_EQ(s.current_of(MemCategory::kActivations), 40);
      EXPECT_EQ(s.current_of(MemCategory::kParameters), 200000);
      EXPECT_EQ(fake.allocations, 2);
    }
    EXPECT_EQ(tracker.stats().current_total, 0);
    EXPECT_EQ(fake.releases, 1);  // the small block; the large one stays in the cache
    Tensor again = Tensor::empty({100000}, DType::kBF16, MemCategory::kParameters, tracker);
    EXPECT_EQ(fake.allocations, 2);  // served from the cache
    EXPECT_EQ(tracker.stats().cache_hits, 1);
  }  // the tracker's destructor returns the cached block to the fake allocator
  EXPECT_EQ(fake.releases, fake.allocations);
}

// Device memory on a private tracker: set-up copies in and out, zeros, the pool's reuse, and
// an impossible request refused with the GPU's free memory in the Status.
TEST(DeviceMemory, CopiesZerosReuseAndRefusal) {
  FP_REQUIRE_GPU();
  auto cuda = make_cuda_backend();  // no per-op waits: copy_to_host waits where the host reads
  MemoryTracker device;
  use_cuda_memory(device, CudaMemory::kDevice);
  {
    Tensor z = Tensor::zeros({1000}, DType::kF32, MemCategory::kActivations, device);
    EXPECT_EQ(read_host_f32(z), std::vector<float>(1000, 0.0f));
    std::vector<float> v(1000);
    for (int i = 0; i < 1000; ++i) v[i] = static_cast<float>(i) - 3.5f;
    write_host_f32(v, z);
    cuda->scale_inplace(2.0, z);
    std::vector<float> back(1000);
    cuda->copy_to_host(z, std::as_writable_bytes(std::span<float>(back)));
    for (int i = 0; i < 1000; ++i) EXPECT_EQ(back[i], 2 * v[i]) << i;
  }
  const BlockPoolStats before = cuda_memory_pool_stats(CudaMemory::kDevice);
  { Tensor again = Tensor::empty({1000}, DType::kF32, MemCategory::kActivations, device); }
  EXPECT_EQ(cuda_memory_pool_stats(CudaMemory::kDevice).hits, before.hits + 1);
  Result<Tensor> huge = Tensor::try_empty({int64_t{1} << 46}, DType::kF32, MemCategory::kActivations, device);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(huge.status().to_string().find("free of"), std::string::npos) << huge.status().to_string();
}

// Tensor's own copies on device memory (clone, copy_from, zero, to): through the block
// allocator (cudaMemcpy, cudaMemset) or the host between explicit copies, never a host
// touch of the block. The first GPU run's AdamW masters (`to`) faulted here.
TEST(DeviceMemory, TensorCopiesCloneZeroAndConvert) {
  FP_REQUIRE_GPU();
  MemoryTracker device;
  use_cuda_memory(device, CudaMemory::kDevice);
  std::vector<float> v(777);
  for (int i = 0; i < 777; ++i) v[i] = 0.25f * static_cast<float>(i) - 40.0f;  // exact in bf16
  Tensor x = Tensor::empty({777}, DType::kF32, MemCategory::kActivations, device);
  write_host_f32(v, x);
  EXPECT_EQ(read_host_f32(x.clone(MemCategory::kWorkspace)), v);
  Tensor y = Tensor::empty({777}, DType::kF32, MemCategory::kActivations, device);
  y.copy_from(x);
  EXPECT_EQ(read_host_f32(y), v);
  const Tensor b = x.to(DType::kBF16, MemCategory::kWorkspace);
  EXPECT_EQ(b.dtype(), DType::kBF16);
  EXPECT_EQ(read_host_f32(b.to(DType::kF32, MemCategory::kWorkspace)), v);
  y.zero();
  EXPECT_EQ(read_host_f32(y), std::vector<float>(777, 0.0f));
}

TEST(PinnedMemory, KernelWritesHostReads) {
  FP_REQUIRE_GPU();
  auto cuda = make_cuda_backend(gpu_test::synced_options());
  Tensor t = Tensor::empty({1 << 20}, DType::kF32, MemCategory::kActivations);
  cuda->fill(2.5, t);
  double sum = 0;
  for (int64_t i = 0; i < t.numel(); ++i) sum += t.data<float>()[i];
  EXPECT_EQ(sum, 2.5 * t.numel());
  EXPECT_EQ(MemoryTracker::process().stats().current_of(MemCategory::kActivations), 4 << 20);
}

}  // namespace
}  // namespace foldpar
