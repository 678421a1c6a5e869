// The tracked allocator: every byte of tensor storage in foldpar comes from here, tagged
// with what it is for. Later issues compare these peaks across parallel layouts and hold
// them to formulas, so the counts are exact: a tensor of n elements of dtype t counts
// n * dtype_size(t) bytes, alignment padding is not counted, and a view counts nothing.
//
// MemoryTracker::process() is the one process-wide instance (it mirrors the process heap,
// as cudaMalloc mirrors a device); tests may build private instances. Thread-safe.
// MemoryTracker::current() is where tensors go by default: process(), unless a
// ScopedDefaultTracker on this thread names another (a dry run's storage-less tracker,
// made by make_storageless(): same counts, no storage; tensor/storageless_allocator.h).
//
// Blocks of kCacheMinBytes or more are kept after release and handed out again for a
// request of the same size class (training steps allocate the same shapes every step; fresh
// pages cost a page fault each, 5-12 us on the VMs measured here). The classes are geometric,
// 8 per doubling (block_size), so that sizes which change from step to step (a MoE expert's
// rows, a prompt's length) share blocks; and the cache holds at most twice the most bytes of
// blocks ever live at once, releasing the least recently released blocks beyond that. Without both,
// a MoE model's training kept every block it ever made (docs/PERFORMANCE.md, "The block
// cache under MoE"). Cached bytes are NOT counted as live: the counters describe tensors,
// `cached_bytes` what the cache holds on top. The cache is off under AddressSanitizer so
// that use-after-free is still caught.
//
// Blocks come from aligned_alloc unless a BlockAllocator is installed (the CUDA program
// installs device memory, cudaMalloc behind a caching pool; tests install the guarded
// stand-in, tensor/guarded_allocator.h; docs/GPU.md). Host code then reaches tensor bytes
// only through explicit copies (Tensor::copy_from_host/copy_to_host, Backend ops). The
// counters do not depend on where blocks come from.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

namespace foldpar {

enum class MemCategory : uint8_t {
  kParameters = 0,   // model weights (and fp32 master weights)
  kGradients,        // gradients of the weights
  kOptimizer,        // optimizer state (AdamW moments)
  kActivations,      // tensors saved for backward, and forward/backward outputs
  kComm,             // communication buffers (weight shards in flight, gathered K/V)
  kWorkspace,        // scratch that lives only inside one op or one block
  kKvCache,          // generation: the keys and values of every cached token
};
constexpr int kNumMemCategories = 7;
std::string_view mem_category_name(MemCategory c);  // "parameters", "gradients", ...

struct MemoryStats {
  std::array<int64_t, kNumMemCategories> current{};  // bytes live now, per category
  std::array<int64_t, kNumMemCategories> peak{};     // highest `current` seen, per category
  int64_t current_total = 0;                         // sum of current over categories
  int64_t peak_total = 0;                            // highest current_total seen (not the sum of peaks)
  std::array<int64_t, kNumMemCategories> at_peak{};  // `current` when peak_total was reached (sums to it)
  int64_t live_allocations = 0;
  int64_t total_allocations = 0;                     // allocations ever made
  int64_t cached_bytes = 0;                          // released blocks kept for reuse (not live)
  int64_t cache_hits = 0;                            // allocations served from the cache
  int64_t cache_evictions = 0;  // cached blocks returned to the system to stay within the bound
  // Bytes moved by explicit copies between host memory and this tracker's tensors
  // (Tensor::copy_from_host/copy_to_host and the backends' copy_from_host/copy_to_host),
  // since the tracker began: what crosses the bus where tensors are device memory.
  int64_t host_bytes_in = 0;                         // host -> tensors
  int64_t host_bytes_out = 0;                        // tensors -> host

  int64_t current_of(MemCategory c) const { return current[static_cast<int>(c)]; }
  int64_t peak_of(MemCategory c) const { return peak[static_cast<int>(c)]; }
};

// A source of raw blocks for a MemoryTracker. Implementations must be thread-safe.
class BlockAllocator {
 public:
  virtual ~BlockAllocator() = default;
  // At least `bytes` (> 0) bytes aligned to MemoryTracker::kAlignment, or nullptr.
  virtual void* allocate(size_t bytes) = 0;
  // `bytes` is the value given to allocate().
  virtual void release(void* ptr, size_t bytes) = 0;
  // Zeroes `bytes` bytes of a block (Tensor::zeros): a memset where host code may write the
  // blocks; device memory and the guarded stand-in override it.
  virtual void fill_zero(void* ptr, size_t bytes);
  // Explicit copies between host memory and a block (Tensor::copy_from_host/copy_to_host):
  // a memcpy by default; cudaMemcpy on a device, a window of its own for the guard.
  virtual void copy_in(void* block, const void* host, size_t bytes);
  virtual void copy_out(void* host, const void* block, size_t bytes);
  // A copy between two blocks of this allocator (Tensor::clone, copy_from): a memmove by
  // default; cudaMemcpy on a device (no host bytes cross), a window of its own for the guard.
  virtual void copy_within(void* dst, const void* src, size_t bytes);
  // Why the latest allocate() returned nullptr ("cudaMalloc: out of memory; 2.0 GiB asked,
  // 1.5 GiB free of 80 GiB"), empty when it does not say; part of the out-of-memory Status.
  virtual std::string failure_reason() const { return {}; }
};

class MemoryTracker {
 public:
  static constexpr size_t kAlignment = 64;
  static constexpr size_t kCacheMinBytes = 64 * 1024;  // smaller blocks go straight back to malloc
  // Blocks of kCacheMinBytes or more come in kCacheClassesPerDoubling sizes between two
  // powers of two (block_size): at most 1/8 above the request.
  static constexpr size_t kCacheClassesPerDoubling = 8;
  // The cache holds at most this many times the most bytes of blocks ever live at once. At 1
  // a MoE step's blocks released in the backward pushed out those its next forward takes
  // (gather and a2a steps 5-30% slower); at 2 they stay, and resident memory stays within
  // 3x the live peak.
  static constexpr int64_t kCacheBoundFactor = 2;
  static constexpr size_t kMaxAllocationBytes = size_t{1} << 48;  // larger requests fail (no wrap-around)

  MemoryTracker();
  ~MemoryTracker();
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  static MemoryTracker& process();
  // Host memory always, whatever process() is backed by: staging for files (checkpoint
  // blocks, safetensors reads), which host code reads and writes. Never given a
  // BlockAllocator. Under `--device cuda` process() holds device memory (use_cuda_memory),
  // so staging there would be device memory that the host cannot touch.
  static MemoryTracker& host_staging();
  // This thread's default tracker: the innermost ScopedDefaultTracker's, else process().
  static MemoryTracker& current();
  // A tracker in "meta" mode: it counts exactly as any tracker does, but its blocks are
  // addresses without storage (StoragelessAllocator, reserving `reserve_bytes` of address
  // space; 0: its default), so tensors made from it fail on host access. The reservation
  // goes with the tracker.
  static std::unique_ptr<MemoryTracker> make_storageless(size_t reserve_bytes = 0);
  // Whether this tracker's blocks have no storage (made by make_storageless).
  bool storageless() const { return storageless_; }

  // Returns kAlignment-aligned memory of at least max(bytes, 1) bytes, counted as `bytes`;
  // nullptr when the system is out of memory (the caller turns that into a Status).
  void* allocate(size_t bytes, MemCategory category);
  // `bytes` and `category` must be those given to allocate().
  void release(void* ptr, size_t bytes, MemCategory category);

  // Zeroes `bytes` bytes at `ptr`, a block of this tracker, the way its blocks allow (the
  // BlockAllocator's fill_zero; a memset by default). Tensor::zeros calls it.
  void fill_zero(void* ptr, size_t bytes);
  // Host bytes into a block of this tracker and back, the way its blocks allow.
  void copy_in(void* block, const void* host, size_t bytes);
  void copy_out(void* host, const void* block, size_t bytes);
  // BlockAllocator::copy_within (a memmove by default); not counted as host bytes.
  void copy_within(void* dst, const void* src, size_t bytes);
  // Counts a copy made elsewhere (a Backend's copy_from_host/copy_to_host) in
  // MemoryStats::host_bytes_in / host_bytes_out; copy_in and copy_out count themselves.
  void count_host_copy(int64_t bytes_in, int64_t bytes_out);
  // The installed BlockAllocator's failure_reason(); empty without one.
  std::string failure_reason() const;

  // The block a request of `bytes` takes: 64-byte aligned below kCacheMinBytes, else the
  // next of kCacheClassesPerDoubling geometric size classes (a multiple of 8 KiB).
  static size_t block_size(size_t bytes);

  MemoryStats stats() const;
  // Sets every peak to the current value, so the next reading is the peak of what follows.
  void reset_peaks();
  // Returns every cached block to the system.
  void release_cache();
  // Caching on or off (on by default, off under AddressSanitizer); turning it off empties it.
  void set_caching(bool enabled);
  // Takes blocks from `allocator` from now on (nullptr: aligned_alloc, the default). Only
  // while no block is live (FP_CHECK); empties the cache. `allocator` must outlive the
  // tracker or be uninstalled first.
  void set_block_allocator(BlockAllocator* allocator);

 private:

  BlockAllocator* block_allocator() const;
  void release_cache_locked();
  void* allocate_block(size_t size);
  void free_block(void* ptr, size_t size);

  mutable std::mutex mu_;
  MemoryStats stats_;
  bool caching_ = true;
  struct CachedBlock {
    size_t size;
    void* ptr;
  };
  std::list<CachedBlock> lru_;  // the cached blocks, least recently released first
  std::multimap<size_t, std::list<CachedBlock>::iterator> cache_;  // block size -> its blocks in lru_
  int64_t live_block_bytes_ = 0;  // the blocks (block_size) of live tensors
  int64_t high_water_bytes_ = 0;  // the most live_block_bytes_ has been: the cache's bound's unit
  BlockAllocator* block_allocator_ = nullptr;  // null: aligned_alloc / free
  std::unique_ptr<BlockAllocator> owned_allocator_;  // make_storageless: the reservation
  bool storageless_ = false;
};

// Makes `tracker` this thread's MemoryTracker::current() until destroyed (then the previous
// one again). Scopes nest; destroy them in reverse order (FP_CHECK).
class ScopedDefaultTracker {
 public:
  explicit ScopedDefaultTracker(MemoryTracker& tracker);
  ~ScopedDefaultTracker();
  ScopedDefaultTracker(const ScopedDefaultTracker&) = delete;
  ScopedDefaultTracker& operator=(const ScopedDefaultTracker&) = delete;

 private:
  MemoryTracker* tracker_;
  MemoryTracker* previous_;
};

}  // namespace foldpar
