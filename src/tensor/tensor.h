// Tensor: a dtype, a shape and a handle to tracked storage. Always contiguous and row-major.
// Copying a Tensor copies the handle (both refer to the same bytes), as in PyTorch; clone()
// copies the bytes. A view (reshape, narrow) shares the storage and counts no new bytes.
// Storage is host memory, or device memory when a CUDA program installs it under the
// tracker (MemoryTracker::set_block_allocator; docs/GPU.md): host code then moves bytes
// only with copy_from_host/copy_to_host (set-up) or Backend ops (steps); data<T>() gives a
// device pointer, for kernels only. A tensor from a storage-less tracker (MemoryTracker::
// make_storageless, a dry run) has an address but no storage: raw_data() gives the address
// (communicators and views need it), while data<T>() and every host copy fail an FP_CHECK
// naming the tensor, and a raw dereference faults.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/status.h"
#include "tensor/dtype.h"
#include "tensor/memory_tracker.h"
#include "tensor/shape.h"

namespace foldpar {

class Tensor {
 public:
  Tensor() = default;  // undefined: holds no storage

  // Uninitialized storage, counted under `category`. Aborts when the system refuses the
  // memory; use try_empty where the size comes from outside (a file, a flag).
  static Tensor empty(const Shape& shape, DType dtype, MemCategory category,
                      MemoryTracker& tracker = MemoryTracker::current());
  static Result<Tensor> try_empty(const Shape& shape, DType dtype, MemCategory category,
                                  MemoryTracker& tracker = MemoryTracker::current());
  // Zero-filled storage; from a storage-less tracker, a tensor like empty's (no contents).
  static Tensor zeros(const Shape& shape, DType dtype, MemCategory category,
                      MemoryTracker& tracker = MemoryTracker::current());

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  // Extent of dim i; negative i counts from the end.
  int64_t dim(int i) const { return shape_[i < 0 ? i + shape_.rank() : i]; }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  MemCategory category() const;

  void* raw_data() { return static_cast<char*>(base()) + offset_bytes_; }
  const void* raw_data() const { return static_cast<const char*>(base()) + offset_bytes_; }
  // False for a tensor of a storage-less tracker (a dry run).
  bool has_storage() const { return has_storage_; }
  template <typename T>
  T* data() {
    FP_CHECK(dtype_ == DTypeOf<T>::value, "tensor is {}, accessed as {}", dtype_name(dtype_),
             dtype_name(DTypeOf<T>::value));
    if (!has_storage_) fail_host_access();
    return static_cast<T*>(raw_data());
  }
  template <typename T>
  const T* data() const {
    FP_CHECK(dtype_ == DTypeOf<T>::value, "tensor is {}, accessed as {}", dtype_name(dtype_),
             dtype_name(DTypeOf<T>::value));
    if (!has_storage_) fail_host_access();
    return static_cast<const T*>(raw_data());
  }

  // A view with another shape of the same element count.
  Tensor reshape(const Shape& shape) const;
  // A view of rows [begin, end) along dim 0.
  Tensor narrow(int64_t begin, int64_t end) const;
  // clone, zero and copy_from go through the tracker's BlockAllocator (copy_within,
  // fill_zero: a memmove/memset on the host, cudaMemcpy/cudaMemset on a device); `to`
  // converts on the host between two explicit copies (copy_to_host, copy_from_host). So
  // all four are safe on device memory; none is meant for a step's hot path.
  // A copy in new storage, counted under `category`.
  Tensor clone(MemCategory category) const;
  // A copy converted to `dtype` (f32/f64/bf16 among themselves; rounding to nearest even).
  Tensor to(DType dtype, MemCategory category) const;
  void zero();
  // Copies the bytes of `src` (same shape and dtype; a block of the same allocator) into
  // this tensor.
  void copy_from(const Tensor& src);
  // The explicit host boundary of set-up code that has no Backend (weight init, checkpoint
  // files): exactly nbytes() bytes from host memory into this tensor, or out of it, through
  // the tracker's BlockAllocator (a memcpy on the host, cudaMemcpy on a device, a window
  // of its own under the guarded stand-in). Synchronous. Steps use Backend::copy_from_host
  // and copy_to_host instead, which are ordered with the ops around them.
  void copy_from_host(std::span<const std::byte> src);
  void copy_to_host(std::span<std::byte> dst) const;
  // A Backend's copy_from_host/copy_to_host of this tensor, counted by its tracker
  // (MemoryStats::host_bytes_in / host_bytes_out), as the copies above count themselves.
  void count_host_copy(int64_t bytes_in, int64_t bytes_out) const;

  bool shares_storage_with(const Tensor& other) const { return storage_ && storage_ == other.storage_; }
  std::string describe() const;  // "f32[2, 3] activations"

 private:
  struct Storage;
  void* base() const;
  [[noreturn]] void fail_host_access() const;

  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DType::kF32;
  bool has_storage_ = true;
};

// Set-up helpers over Tensor::copy_to_host/copy_from_host: the elements of an f32, bf16 or
// f64 tensor as host floats (bf16 widened exactly), and host floats stored into one (rounded
// to nearest even for bf16). `values` holds exactly t.numel() elements.
std::vector<float> read_host_f32(const Tensor& t);
void write_host_f32(std::span<const float> values, Tensor& t);

}  // namespace foldpar
