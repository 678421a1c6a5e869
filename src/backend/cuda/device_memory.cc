// The CUDA BlockAllocators under a MemoryTracker: device memory (cudaMalloc) for the program
// and the benchmark, or pinned host memory (cudaHostAlloc, mapped: kernels address it over
// the bus) for GPU tests that read results on the host. Both sit behind a BlockPool
// (tensor/block_pool.h): cudaMalloc and cudaFree synchronize the device, so blocks are
// cached by size class and reused. No managed memory anywhere (issue 20: on the GPU machine
// oversubscribed managed memory can hang the card).
//
// Device memory is checked against cudaMemGetInfo before the pool grows: a request beyond
// what the GPU has free fails at once (the pool first returns its cache and asks again), and
// the tracker's out-of-memory Status carries failure_reason() (the CUDA error or the free
// memory). Host bytes cross only through copy_in/copy_out/fill_zero (and blocks are copied
// through copy_within), which wait for the whole device before and after (set-up paths:
// weights, checkpoints, batches).
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <string>

#include "backend/cuda/cuda_backend.h"
#include "cuda/cuda_check.h"
#include "tensor/block_pool.h"

namespace foldpar {
namespace {

std::string gib(size_t bytes) { return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1 << 30)); }

// What a refused block says; written by the source under the pool's lock.
struct FailureNote {
  mutable std::mutex mu;
  std::string text;
  void set(std::string t) {
    std::lock_guard<std::mutex> lock(mu);
    text = std::move(t);
  }
  std::string get() const {
    std::lock_guard<std::mutex> lock(mu);
    return text;
  }
};

struct DeviceSource {
  FailureNote* note;
  void* allocate(size_t bytes) {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaError_t rc = cudaMemGetInfo(&free_bytes, &total_bytes); rc != cudaSuccess) {
      (void)cudaGetLastError();
      note->set(fmt::format("cudaMemGetInfo: {}", cudaGetErrorString(rc)));
      return nullptr;
    }
    if (bytes > free_bytes) {
      note->set(fmt::format("the GPU has {} free of {}; {} asked", gib(free_bytes), gib(total_bytes), gib(bytes)));
      return nullptr;
    }
    void* p = nullptr;
    if (cudaError_t rc = cudaMalloc(&p, bytes); rc != cudaSuccess) {
      (void)cudaGetLastError();
      note->set(fmt::format("cudaMalloc of {}: {} ({} free of {})", gib(bytes), cudaGetErrorString(rc),
                            gib(free_bytes), gib(total_bytes)));
      return nullptr;
    }
    return p;
  }
  // At process exit the runtime may already be torn down; nothing is left to check then.
  void release(void* p, size_t) { (void)cudaFree(p); }
};

struct PinnedHostSource {
  FailureNote* note;
  void* allocate(size_t bytes) {
    void* p = nullptr;
    if (cudaError_t rc = cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable); rc != cudaSuccess) {
      (void)cudaGetLastError();
      note->set(fmt::format("cudaHostAlloc of {}: {}", gib(bytes), cudaGetErrorString(rc)));
      return nullptr;
    }
    return p;
  }
  void release(void* p, size_t) { (void)cudaFreeHost(p); }
};

template <typename Source>
class CudaBlockAllocator final : public BlockAllocator {
 public:
  CudaBlockAllocator() : pool_(Source{&note_}) {}
  void* allocate(size_t bytes) override { return pool_.allocate(bytes); }
  void release(void* ptr, size_t bytes) override { pool_.release(ptr, bytes); }
  // Set-up copies: every pending kernel (on any stream) first, then the copy, then a wait for
  // it. cudaMemset, a device-to-device cudaMemcpy and a copy from pageable host memory may
  // return before the bytes land, and the backend's stream is non-blocking (it does not wait
  // for the legacy stream these run on), so without the second wait its next kernel could
  // read the old bytes.
  template <typename Op>
  static void set_up(Op op) {
    FP_CUDA_CHECK(cudaDeviceSynchronize());
    op();
    FP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void fill_zero(void* ptr, size_t bytes) override {
    set_up([&] { FP_CUDA_CHECK(cudaMemset(ptr, 0, bytes)); });
  }
  void copy_in(void* block, const void* host, size_t bytes) override {
    set_up([&] { FP_CUDA_CHECK(cudaMemcpy(block, host, bytes, cudaMemcpyDefault)); });
  }
  void copy_out(void* host, const void* block, size_t bytes) override {
    set_up([&] { FP_CUDA_CHECK(cudaMemcpy(host, block, bytes, cudaMemcpyDefault)); });
  }
  void copy_within(void* dst, const void* src, size_t bytes) override {
    set_up([&] { FP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault)); });
  }
  std::string failure_reason() const override { return note_.get(); }
  BlockPoolStats stats() const { return pool_.stats(); }

 private:
  FailureNote note_;
  BlockPool<Source> pool_;
};

// Process-wide and never destroyed: they outlive every tracker.
CudaBlockAllocator<DeviceSource>& device_allocator() {
  static auto* a = new CudaBlockAllocator<DeviceSource>();
  return *a;
}
CudaBlockAllocator<PinnedHostSource>& pinned_allocator() {
  static auto* a = new CudaBlockAllocator<PinnedHostSource>();
  return *a;
}

}  // namespace

void use_cuda_memory(MemoryTracker& tracker, CudaMemory kind) {
  if (kind == CudaMemory::kDevice) {
    tracker.set_block_allocator(&device_allocator());
  } else {
    tracker.set_block_allocator(&pinned_allocator());
  }
}

BlockPoolStats cuda_memory_pool_stats(CudaMemory kind) {
  return kind == CudaMemory::kDevice ? device_allocator().stats() : pinned_allocator().stats();
}

}  // namespace foldpar
