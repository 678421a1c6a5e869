// The BlockAllocator hook of MemoryTracker, which the CUDA build uses for unified memory:
// with a counting fake allocator (runs everywhere) the counters stay exact and blocks go
// back to the allocator they came from; with unified memory (GPU only) a tensor is
// written by a kernel and read on the host, and freed blocks are reused.
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

TEST(UnifiedMemory, KernelWritesHostReads) {
  FP_REQUIRE_GPU();
  auto cuda = make_cuda_backend();
  Tensor t = Tensor::empty({1 << 20}, DType::kF32, MemCategory::kActivations);
  cuda->fill(2.5, t);
  double sum = 0;
  for (int64_t i = 0; i < t.numel(); ++i) sum += t.data<float>()[i];
  EXPECT_EQ(sum, 2.5 * t.numel());
  EXPECT_EQ(MemoryTracker::process().stats().current_of(MemCategory::kActivations), 4 << 20);
}

}  // namespace
}  // namespace foldpar
