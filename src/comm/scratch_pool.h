// Host buffers the MPI backend stages reductions through (the pairwise exchange's incoming
// blocks, bf16 reductions' f32 copies), kept after use and handed out again.
//
// Why: on the VMs this project measures on, touching a freshly mapped page costs 3-6 us
// (1.4-3 ms per MiB, docs/PERFORMANCE.md "Fresh pages"), and glibc returns large blocks to
// the system on free, so a buffer allocated per call was faulted in on every call: a
// 16 MiB reduce-scatter took 34 ms where its bytes take 1 ms. A taken buffer is not zeroed.
// Sizes of 2 MiB or more round up to a multiple of 2 MiB, so that nearby sizes share buffers.
//
// The pool is process-wide and thread-safe; it keeps at most kMaxKeptBytes of free buffers
// (the largest go first). It is host memory outside MemoryTracker's counts, like the MPI
// library's own buffers.
#pragma once

#include <cstddef>

namespace foldpar {

class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  // At least `bytes` bytes, 64-byte aligned, contents undefined.
  static ScratchBuffer take(size_t bytes);
  ~ScratchBuffer();
  ScratchBuffer(ScratchBuffer&& other) noexcept;
  ScratchBuffer& operator=(ScratchBuffer&& other) noexcept;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;

  std::byte* data() const { return data_; }
  size_t capacity() const { return capacity_; }

  static constexpr size_t kMaxKeptBytes = size_t{1} << 30;
  // Free buffers kept by the pool now, in bytes (tests).
  static size_t kept_bytes();

 private:
  ScratchBuffer(std::byte* data, size_t capacity) : data_(data), capacity_(capacity) {}
  std::byte* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace foldpar
