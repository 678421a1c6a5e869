// GuardedAllocator: the CPU stand-in for device memory (issue 20). A BlockAllocator whose
// blocks are real memory that host code cannot touch between Backend calls: they are carved
// from one reservation (StoragelessAllocator's carving, tensor/storageless_allocator.h) that
// is mprotect'ed PROT_NONE except while a Backend op, a communicator operation or an explicit
// copy holds it open (GuardOpen). A host read or write of tensor data anywhere else faults,
// as a host dereference of a cudaMalloc pointer would, and the fault handler
// (install_storageless_fault_handler) names it before the process dies.
//
// One open window for the whole reservation (one mprotect per window, not one per block):
// while any op holds it open every guarded block is accessible, including to other threads.
// Windows nest (a counter); the guard is process-wide, like the device it stands for.
// Non-blocking transfers keep it open until they complete (comm/guarded_communicator.h), so
// a host touch while a transfer is in flight is not caught.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "tensor/memory_tracker.h"
#include "tensor/storageless_allocator.h"

namespace foldpar {

class GuardedAllocator final : public BlockAllocator {
 public:
  // 64 GiB of address space (no memory until touched): far above what a test's model holds.
  static constexpr size_t kDefaultReserveBytes = size_t{64} << 30;
  explicit GuardedAllocator(size_t reserve_bytes = kDefaultReserveBytes);
  ~GuardedAllocator() override;
  GuardedAllocator(const GuardedAllocator&) = delete;
  GuardedAllocator& operator=(const GuardedAllocator&) = delete;

  void* allocate(size_t bytes) override;  // nullptr when the reservation is full
  void release(void* ptr, size_t bytes) override;
  // Zeroes the block inside a window of its own: zero at allocation is a property of the
  // block (cudaMemset on a device), not a host write.
  void fill_zero(void* ptr, size_t bytes) override;
  void copy_in(void* block, const void* host, size_t bytes) override;
  void copy_out(void* host, const void* block, size_t bytes) override;
  void copy_within(void* dst, const void* src, size_t bytes) override;

  // Opens (first open: PROT_READ|PROT_WRITE) and closes (last close: PROT_NONE) the window.
  void open();
  void close();
  bool is_open() const;
  bool contains(const void* ptr) const { return range_.contains(ptr); }
  void* base() const { return range_.base(); }
  size_t reserved_bytes() const { return range_.reserved_bytes(); }
  int64_t windows_opened() const;  // 0 -> 1 transitions so far (a test's sanity count)

 private:
  void protect_locked(bool accessible);

  StoragelessAllocator range_;
  mutable std::mutex mu_;
  int depth_ = 0;
  int64_t windows_ = 0;
  size_t high_water_ = 0;  // bytes from the base that were ever handed out: the span to mprotect
};

// Holds `guard` open for its lifetime; a null guard does nothing (unguarded runs).
class GuardOpen {
 public:
  explicit GuardOpen(GuardedAllocator* guard) : guard_(guard) {
    if (guard_ != nullptr) guard_->open();
  }
  ~GuardOpen() {
    if (guard_ != nullptr) guard_->close();
  }
  GuardOpen(const GuardOpen&) = delete;
  GuardOpen& operator=(const GuardOpen&) = delete;

 private:
  GuardedAllocator* guard_;
};

}  // namespace foldpar
