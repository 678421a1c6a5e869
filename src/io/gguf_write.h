// GGUF version 3 files (the format llama.cpp reads), written from the published format
// description: magic "GGUF", version, tensor and key-value counts, typed key-value metadata,
// tensor descriptors (name, dimensions innermost first, ggml type, offset), then the tensor
// data, each tensor starting at a multiple of kGgufAlignment. Little-endian throughout. The
// Llama-specific keys and tensor names live in checkpoint/gguf_export.h; this file knows
// only the container.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace foldpar {

constexpr uint32_t kGgufVersion = 3;
constexpr uint64_t kGgufAlignment = 32;  // general.alignment's default; we never write another

// ggml's element types for the tensors we write.
enum class GgufTensorType : uint32_t { kF32 = 0, kF16 = 1, kBF16 = 30 };
std::string_view gguf_tensor_type_name(GgufTensorType t);

// The metadata section: key-value pairs in the order added. Keys are unique (CHECKed).
class GgufMetadata {
 public:
  void add_u32(std::string_view key, uint32_t v);
  void add_f32(std::string_view key, float v);
  void add_bool(std::string_view key, bool v);
  void add_string(std::string_view key, std::string_view v);
  void add_string_array(std::string_view key, const std::vector<std::string>& v);
  void add_i32_array(std::string_view key, const std::vector<int32_t>& v);
  void add_f32_array(std::string_view key, const std::vector<float>& v);

  uint64_t count() const { return keys_.size(); }
  const std::string& bytes() const { return bytes_; }

 private:
  void begin(std::string_view key, uint32_t value_type);
  std::vector<std::string> keys_;
  std::string bytes_;
};

// One tensor: `shape` row-major, outermost first (a [out, in] weight is {out, in}; the file
// stores the reverse, ggml's ne[0] = in). `values` holds numel f32 values, converted to
// `type` (f16 and bf16 round to nearest even) as the file is written; borrowed.
struct GgufTensor {
  std::string name;
  std::vector<int64_t> shape;
  GgufTensorType type = GgufTensorType::kF32;
  std::span<const float> values;
};

// f32 -> IEEE half, round to nearest even (subnormals, overflow to inf, NaN kept).
uint16_t f32_to_f16_bits(float x);

// Writes the file atomically (io/atomic_file.h). invalid_argument for a tensor whose values
// do not match its shape, or a repeated tensor name.
Status write_gguf(const std::string& path, const GgufMetadata& metadata, const std::vector<GgufTensor>& tensors);

}  // namespace foldpar
