// Tensor storage, views and conversions.
#include "tensor/tensor.h"

#include <cstdlib>
#include <cstring>
#include <vector>

namespace foldpar {

struct Tensor::Storage {
  void* ptr = nullptr;
  size_t bytes = 0;
  MemCategory category = MemCategory::kWorkspace;
  MemoryTracker* tracker = nullptr;
  ~Storage() { tracker->release(ptr, bytes, category); }
};

void* Tensor::base() const {
  FP_CHECK(storage_ != nullptr, "access to an undefined tensor");
  return storage_->ptr;
}

void Tensor::fail_host_access() const {
  FP_CHECK(false, "host access to {}, which has no storage (dry run)", describe());
  std::abort();
}

MemCategory Tensor::category() const {
  FP_CHECK(storage_ != nullptr, "category of an undefined tensor");
  return storage_->category;
}

Result<Tensor> Tensor::try_empty(const Shape& shape, DType dtype, MemCategory category,
                                 MemoryTracker& tracker) {
  // Sizes may come from outside (a file, a flag): refuse products that overflow rather than
  // allocate a wrapped-around small block.
  size_t bytes = dtype_size(dtype);
  for (int i = 0; i < shape.rank(); ++i) {
    if (__builtin_mul_overflow(bytes, static_cast<size_t>(shape[i]), &bytes) ||
        bytes > MemoryTracker::kMaxAllocationBytes) {
      return Status(StatusCode::kOutOfMemory, fmt::format("cannot allocate {} {}{}: the size overflows",
                                                          mem_category_name(category), dtype_name(dtype),
                                                          shape.to_string()));
    }
  }
  void* ptr = tracker.allocate(bytes, category);
  if (ptr == nullptr) {
    const std::string why = tracker.failure_reason();
    return Status(StatusCode::kOutOfMemory,
                  fmt::format("cannot allocate {} bytes for {} {}{}{}{}", bytes, mem_category_name(category),
                              dtype_name(dtype), shape.to_string(), why.empty() ? "" : ": ", why));
  }
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->ptr = ptr;
  t.storage_->bytes = bytes;
  t.storage_->category = category;
  t.storage_->tracker = &tracker;
  t.has_storage_ = !tracker.storageless();
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, MemCategory category, MemoryTracker& tracker) {
  Result<Tensor> t = try_empty(shape, dtype, category, tracker);
  FP_CHECK_OK(t.status());
  return std::move(t).value();
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, MemCategory category, MemoryTracker& tracker) {
  Tensor t = empty(shape, dtype, category, tracker);
  // Zeroed at allocation (as calloc or a device's memset-at-allocation): a property of the
  // block, not a host write to the tensor, so a storage-less block (no contents) skips it.
  if (t.has_storage_) tracker.fill_zero(t.raw_data(), t.nbytes());
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  FP_CHECK(shape.numel() == numel(), "reshape of {} to {}", shape_.to_string(), shape.to_string());
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::narrow(int64_t begin, int64_t end) const {
  FP_CHECK(rank() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], "narrow [{}, {}) of {}", begin,
           end, shape_.to_string());
  Tensor t = *this;
  t.shape_[0] = end - begin;
  t.offset_bytes_ += static_cast<size_t>(begin * shape_.stride(0)) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::clone(MemCategory category) const {
  if (!has_storage_) fail_host_access();
  Tensor t = empty(shape_, dtype_, category, *storage_->tracker);
  storage_->tracker->copy_within(t.raw_data(), raw_data(), nbytes());
  return t;
}

void Tensor::zero() {
  if (!has_storage_) fail_host_access();
  if (numel() > 0) storage_->tracker->fill_zero(raw_data(), nbytes());
}

void Tensor::copy_from(const Tensor& src) {
  FP_CHECK(src.shape_ == shape_ && src.dtype_ == dtype_, "copy of {} into {}", src.describe(), describe());
  if (!has_storage_) fail_host_access();
  if (!src.has_storage_) src.fail_host_access();
  if (numel() > 0) storage_->tracker->copy_within(raw_data(), src.raw_data(), nbytes());
}

void Tensor::copy_from_host(std::span<const std::byte> src) {
  FP_CHECK(src.size() == nbytes(), "{} host bytes into {} ({} bytes)", src.size(), describe(), nbytes());
  if (!has_storage_) fail_host_access();
  storage_->tracker->copy_in(raw_data(), src.data(), src.size());
}

void Tensor::count_host_copy(int64_t bytes_in, int64_t bytes_out) const {
  if (storage_ != nullptr) storage_->tracker->count_host_copy(bytes_in, bytes_out);
}

void Tensor::copy_to_host(std::span<std::byte> dst) const {
  FP_CHECK(dst.size() == nbytes(), "{} ({} bytes) into {} host bytes", describe(), nbytes(), dst.size());
  if (!has_storage_) fail_host_access();
  storage_->tracker->copy_out(dst.data(), raw_data(), dst.size());
}

namespace {
double load_as_f64(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kF64: return static_cast<const double*>(p)[i];
    case DType::kBF16: return bf16_to_f32(static_cast<const bf16*>(p)[i]);
    default: FP_CHECK(false, "conversion from {}", dtype_name(t));
  }
  return 0;
}
void store_from_f64(DType t, void* p, int64_t i, double v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case DType::kF64: static_cast<double*>(p)[i] = v; return;
    case DType::kBF16: static_cast<bf16*>(p)[i] = f32_to_bf16(static_cast<float>(v)); return;
    default: FP_CHECK(false, "conversion to {}", dtype_name(t));
  }
}
}  // namespace

Tensor Tensor::to(DType dtype, MemCategory category) const {
  if (dtype == dtype_) return clone(category);
  if (!has_storage_) fail_host_access();
  Tensor t = empty(shape_, dtype, category, *storage_->tracker);
  // Through the host, as explicit copies (counted): the blocks may be device memory. A
  // set-up path (f32 masters of bf16 weights), not a step's.
  const int64_t n = numel();
  std::vector<std::byte> from(nbytes()), to(t.nbytes());
  copy_to_host(from);
  // f64 -> bf16 goes through f32 first, as a bf16 store of an f32 value would.
  for (int64_t i = 0; i < n; ++i) store_from_f64(dtype, to.data(), i, load_as_f64(dtype_, from.data(), i));
  t.copy_from_host(to);
  return t;
}

std::vector<float> read_host_f32(const Tensor& t) {
  const int64_t n = t.numel();
  std::vector<std::byte> bytes(t.nbytes());
  t.copy_to_host(bytes);
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = static_cast<float>(load_as_f64(t.dtype(), bytes.data(), i));
  return out;
}

void write_host_f32(std::span<const float> values, Tensor& t) {
  const int64_t n = t.numel();
  FP_CHECK(static_cast<int64_t>(values.size()) == n, "{} host values into {}", values.size(), t.describe());
  std::vector<std::byte> bytes(t.nbytes());
  for (int64_t i = 0; i < n; ++i) store_from_f64(t.dtype(), bytes.data(), i, values[static_cast<size_t>(i)]);
  t.copy_from_host(bytes);
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined";
  return fmt::format("{}{} {}", dtype_name(dtype_), shape_.to_string(), mem_category_name(category()));
}

}  // namespace foldpar
