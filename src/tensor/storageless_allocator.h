// StoragelessAllocator: a BlockAllocator for dry runs (docs/design.md, Planning / dry run).
// It hands out real, distinct, non-overlapping, aligned addresses carved from one address
// range reserved with mmap(PROT_NONE, MAP_NORESERVE): no physical page and no swap stands
// behind them, and any host read or write faults. A MemoryTracker made with
// MemoryTracker::make_storageless() owns one, so its counters (categories, peaks) are
// exactly those of a real run while tensors made from it have no storage (Tensor::data<T>()
// fails an FP_CHECK naming the tensor).
//
// The reservation is released when the allocator is destroyed, so many dry runs in one
// process do not exhaust the 47-bit address space; freed ranges are reused within a run
// (best fit, neighbours coalesced). install_storageless_fault_handler() makes a fault
// inside any live reservation print what it was before the process dies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "tensor/memory_tracker.h"

namespace foldpar {

class StoragelessAllocator final : public BlockAllocator {
 public:
  // Reserves `reserve_bytes` of address space (no memory); the blocks live inside it.
  // Aborts (FP_CHECK) if the system refuses the reservation. `fault_label` (a string
  // literal) is what the fault handler says a faulting address is "inside" (the guarded
  // allocator, tensor/guarded_allocator.h, reuses this reservation with its own words).
  explicit StoragelessAllocator(size_t reserve_bytes = kDefaultReserveBytes,
                                const char* fault_label = "a storage-less block (dry run)");
  ~StoragelessAllocator() override;
  StoragelessAllocator(const StoragelessAllocator&) = delete;
  StoragelessAllocator& operator=(const StoragelessAllocator&) = delete;

  // 4 TiB: far above what one rank of any planned layout holds live at once (a 7B model
  // at S=128K on 8 ranks peaks at tens of GiB), and 1/32 of the 47-bit user space.
  static constexpr size_t kDefaultReserveBytes = size_t{4} << 40;

  void* allocate(size_t bytes) override;  // nullptr when the reservation is full
  void release(void* ptr, size_t bytes) override;

  // Whether `ptr` lies inside this allocator's reservation.
  bool contains(const void* ptr) const;
  size_t reserved_bytes() const { return reserve_bytes_; }
  // The first address of the reservation (page-aligned).
  void* base() const { return base_; }

 private:
  void insert_free(uint64_t offset, uint64_t size);
  void erase_free(std::map<uint64_t, uint64_t>::iterator it);

  char* base_ = nullptr;
  size_t reserve_bytes_ = 0;
  int slot_ = -1;  // index in the fault handler's table of reservations
  std::mutex mu_;
  std::map<uint64_t, uint64_t> free_by_offset_;      // offset -> size
  std::multimap<uint64_t, uint64_t> free_by_size_;   // size -> offset
};

// Installs (once per process; later calls do nothing) a SIGSEGV/SIGBUS handler that, for a
// fault inside a live StoragelessAllocator reservation, prints "host access to address ...
// inside <fault_label>" and a backtrace to stderr, then lets the signal kill
// the process as it would have. Faults elsewhere go to the previous handler. For dry-run
// harnesses and their tests; library code does not call it on its own.
void install_storageless_fault_handler();

}  // namespace foldpar
