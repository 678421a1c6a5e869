// The unified-memory BlockAllocator: cudaMallocManaged blocks for a MemoryTracker. The
// tracker caches blocks of 64 KiB and more; this allocator also keeps the smaller ones
// (cudaMallocManaged costs microseconds and a whole page per call), per exact size.
#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "cuda/cuda_check.h"

namespace foldpar {
namespace {

class UnifiedMemoryAllocator final : public BlockAllocator {
 public:
  void* allocate(size_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = small_.find(bytes);
      if (it != small_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        return p;
      }
    }
    void* p = nullptr;
    if (cudaMallocManaged(&p, bytes, cudaMemAttachGlobal) != cudaSuccess) {
      (void)cudaGetLastError();  // out of memory: the tracker turns nullptr into a Status
      return nullptr;
    }
    return p;
  }
  void release(void* ptr, size_t bytes) override {
    if (bytes < MemoryTracker::kCacheMinBytes) {
      std::lock_guard<std::mutex> lock(mu_);
      small_[bytes].push_back(ptr);
      return;
    }
    // At process exit the runtime may already be torn down; nothing is left to check then.
    (void)cudaFree(ptr);
  }

 private:
  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> small_;
};

}  // namespace

void use_cuda_unified_memory(MemoryTracker& tracker) {
  static UnifiedMemoryAllocator* allocator = new UnifiedMemoryAllocator();  // never destroyed: outlives trackers
  tracker.set_block_allocator(allocator);
}

}  // namespace foldpar
