// SafetensorsFile: opens a file, validates its header (safetensors_header.cc) against the
// file's size, and reads tensors with pread into tracked storage, converting on request.
// Writing lives in safetensors_write.cc.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <limits>

namespace foldpar {

// The data section is copied byte for byte into tensors, which are host-endian.
static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    const int err = errno;
    std::string msg = fmt::format("cannot open '{}': {}", path, errno_message(err));
    return err == ENOENT ? not_found("{}", msg) : io_error("{}", msg);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return io_error("cannot stat '{}': {}", path, errno_message(errno));
  if (!S_ISREG(st.st_mode)) return invalid_argument("'{}' is not a regular file", path);
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);

  std::string prefix(std::min(file_size, kSafetensorsLengthBytes), '\0');
  FP_RETURN_IF_ERROR(read_fully_at(fd.get(), path, 0, prefix.data(), prefix.size()));
  Result<uint64_t> n = parse_safetensors_header_length(prefix, file_size);
  if (!n.ok()) return n.status().with_context(path);
  prefix.resize(kSafetensorsLengthBytes + *n);  // bounded by the file size and the cap
  FP_RETURN_IF_ERROR(read_fully_at(fd.get(), path, kSafetensorsLengthBytes,
                                prefix.data() + kSafetensorsLengthBytes, *n));
  Result<SafetensorsHeader> header = parse_safetensors_header(prefix, file_size);
  if (!header.ok()) return header.status().with_context(path);
  return SafetensorsFile(path, std::move(fd), std::move(header).value());
}

Result<Tensor> SafetensorsFile::read(std::string_view name, MemCategory category, MemoryTracker& tracker) const {
  const SafetensorsEntry* e = header_.find(name);
  if (e == nullptr) return not_found("'{}' has no tensor named '{}'", path_, name);
  Result<Tensor> t = Tensor::try_empty(e->shape, e->dtype, category, tracker);
  if (!t.ok()) return t.status().with_context(fmt::format("{}: tensor '{}'", path_, name));
  if (e->nbytes() > 0) {
    FP_RETURN_IF_ERROR(read_fully_at(fd_.get(), path_, header_.data_start + e->data_begin, t->raw_data(),
                                     e->nbytes()));
  }
  return t;
}

namespace {

bool is_float_dtype(DType t) { return t == DType::kF32 || t == DType::kF64 || t == DType::kBF16; }

// I32 <-> I64; narrowing checks every value.
template <typename From, typename To>
Status convert_integers(const Tensor& src, Tensor& dst, const std::string& what) {
  const From* in = src.data<From>();
  To* out = dst.data<To>();
  for (int64_t i = 0; i < src.numel(); ++i) {
    if constexpr (sizeof(To) < sizeof(From)) {
      if (in[i] < std::numeric_limits<To>::min() || in[i] > std::numeric_limits<To>::max()) {
        return invalid_argument("{} element {} holds {}, outside the {} range [{}, {}]", what, i, in[i],
                                dtype_name(dst.dtype()), std::numeric_limits<To>::min(),
                                std::numeric_limits<To>::max());
      }
    }
    out[i] = static_cast<To>(in[i]);
  }
  return Status::ok_status();
}

}  // namespace

Result<Tensor> SafetensorsFile::read_as(std::string_view name, DType want, MemCategory category,
                                        MemoryTracker& tracker) const {
  const SafetensorsEntry* e = header_.find(name);
  if (e == nullptr) return not_found("'{}' has no tensor named '{}'", path_, name);
  if (e->dtype == want) return read(name, category, tracker);
  const std::string what = fmt::format("'{}': tensor '{}'", path_, name);
  if (is_float_dtype(e->dtype) != is_float_dtype(want)) {
    return invalid_argument("{} is {} and cannot be read as {} (conversions stay within F32/F64/BF16 or I32/I64)",
                            what, dtype_name(e->dtype), dtype_name(want));
  }
  FP_ASSIGN_OR_RETURN(Tensor stored, read(name, MemCategory::kWorkspace, tracker));
  if (is_float_dtype(want)) return stored.to(want, category);
  Result<Tensor> out = Tensor::try_empty(e->shape, want, category, tracker);
  if (!out.ok()) return out.status().with_context(what);
  if (want == DType::kI32) {
    FP_RETURN_IF_ERROR((convert_integers<int64_t, int32_t>(stored, *out, what)));
  } else {
    FP_RETURN_IF_ERROR((convert_integers<int32_t, int64_t>(stored, *out, what)));
  }
  return out;
}

}  // namespace foldpar
