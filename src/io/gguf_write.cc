// GGUF v3 writing: the header in memory, then each tensor converted and written in turn.
#include "io/gguf_write.h"

#include <bit>
#include <cmath>
#include <set>

#include "core/check.h"
#include "io/atomic_file.h"
#include "io/posix_file.h"
#include "tensor/dtype.h"

namespace foldpar {
namespace {

// Value types of the metadata section.
enum : uint32_t { kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kString = 8, kArray = 9 };

template <typename T>
void put(std::string& out, T v) {
  static_assert(std::endian::native == std::endian::little, "GGUF is little-endian; so must the host be");
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

void put_string(std::string& out, std::string_view s) {
  put<uint64_t>(out, s.size());
  out.append(s);
}

uint64_t padded(uint64_t n) { return (n + kGgufAlignment - 1) / kGgufAlignment * kGgufAlignment; }

size_t element_bytes(GgufTensorType t) { return t == GgufTensorType::kF32 ? 4 : 2; }

Status check_tensors(const std::vector<GgufTensor>& tensors) {
  std::set<std::string_view> names;
  for (const GgufTensor& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (t.shape.empty() || numel != static_cast<int64_t>(t.values.size()))
      return invalid_argument("GGUF tensor '{}' has {} values for its shape of {} elements", t.name, t.values.size(),
                              numel);
    if (!names.insert(t.name).second) return invalid_argument("GGUF tensor name '{}' is given twice", t.name);
  }
  return Status::ok_status();
}

std::string build_header(const GgufMetadata& metadata, const std::vector<GgufTensor>& tensors) {
  std::string h;
  h.append("GGUF", 4);
  put<uint32_t>(h, kGgufVersion);
  put<uint64_t>(h, tensors.size());
  put<uint64_t>(h, metadata.count());
  h += metadata.bytes();
  uint64_t offset = 0;
  for (const GgufTensor& t : tensors) {
    put_string(h, t.name);
    put<uint32_t>(h, static_cast<uint32_t>(t.shape.size()));
    for (auto d = t.shape.rbegin(); d != t.shape.rend(); ++d) put<uint64_t>(h, static_cast<uint64_t>(*d));
    put<uint32_t>(h, static_cast<uint32_t>(t.type));
    put<uint64_t>(h, offset);
    offset = padded(offset + t.values.size() * element_bytes(t.type));
  }
  h.append(padded(h.size()) - h.size(), '\0');
  return h;
}

// The tensor's bytes in its file type, zero-padded to the alignment.
std::string encode_tensor(const GgufTensor& t) {
  std::string out;
  out.reserve(padded(t.values.size() * element_bytes(t.type)));
  for (float v : t.values) {
    switch (t.type) {
      case GgufTensorType::kF32: put<float>(out, v); break;
      case GgufTensorType::kF16: put<uint16_t>(out, f32_to_f16_bits(v)); break;
      case GgufTensorType::kBF16: put<uint16_t>(out, f32_to_bf16(v).bits); break;
    }
  }
  out.append(padded(out.size()) - out.size(), '\0');
  return out;
}

}  // namespace

std::string_view gguf_tensor_type_name(GgufTensorType t) {
  switch (t) {
    case GgufTensorType::kF32: return "f32";
    case GgufTensorType::kF16: return "f16";
    case GgufTensorType::kBF16: return "bf16";
  }
  return "?";
}

void GgufMetadata::begin(std::string_view key, uint32_t value_type) {
  for (const std::string& k : keys_) FP_CHECK(k != key, "GGUF key {} added twice", key);
  keys_.emplace_back(key);
  put_string(bytes_, key);
  put<uint32_t>(bytes_, value_type);
}

void GgufMetadata::add_u32(std::string_view key, uint32_t v) {
  begin(key, kU32);
  put(bytes_, v);
}

void GgufMetadata::add_f32(std::string_view key, float v) {
  begin(key, kF32);
  put(bytes_, v);
}

void GgufMetadata::add_bool(std::string_view key, bool v) {
  begin(key, kBool);
  put<uint8_t>(bytes_, v ? 1 : 0);
}

void GgufMetadata::add_string(std::string_view key, std::string_view v) {
  begin(key, kString);
  put_string(bytes_, v);
}

void GgufMetadata::add_string_array(std::string_view key, const std::vector<std::string>& v) {
  begin(key, kArray);
  put<uint32_t>(bytes_, kString);
  put<uint64_t>(bytes_, v.size());
  for (const std::string& s : v) put_string(bytes_, s);
}

void GgufMetadata::add_i32_array(std::string_view key, const std::vector<int32_t>& v) {
  begin(key, kArray);
  put<uint32_t>(bytes_, kI32);
  put<uint64_t>(bytes_, v.size());
  for (int32_t x : v) put(bytes_, x);
}

void GgufMetadata::add_f32_array(std::string_view key, const std::vector<float>& v) {
  begin(key, kArray);
  put<uint32_t>(bytes_, kF32);
  put<uint64_t>(bytes_, v.size());
  for (float x : v) put(bytes_, x);
}

uint16_t f32_to_f16_bits(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;             // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;            // >= 65520 (halfway past 65504, ties to even): inf
  if (a < 0x38800000u) {                                  // below 2^-14: a subnormal half (or zero)
    const float scaled = std::bit_cast<float>(a) * 16777216.0f;  // in units of 2^-24, exact
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));  // default rounding: to nearest even
  }
  const uint32_t mant = a & 0x7fffffu;
  uint32_t h = ((((a >> 23) - 127 + 15) << 10) | (mant >> 13));
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry rolls into the exponent, as it should
  return sign | static_cast<uint16_t>(h);
}

Status write_gguf(const std::string& path, const GgufMetadata& metadata, const std::vector<GgufTensor>& tensors) {
  FP_RETURN_IF_ERROR(check_tensors(tensors));
  const std::string header = build_header(metadata, tensors);
  return write_file_atomically(path, [&](int fd, const std::string& tmp) -> Status {
    FP_RETURN_IF_ERROR(write_fully(fd, tmp, header.data(), header.size()));
    for (const GgufTensor& t : tensors) {
      const std::string bytes = encode_tensor(t);
      FP_RETURN_IF_ERROR(write_fully(fd, tmp, bytes.data(), bytes.size()));
    }
    return Status::ok_status();
  });
}

}  // namespace foldpar
