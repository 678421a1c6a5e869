// DType names as the safetensors format spells them.
#include "tensor/dtype.h"

namespace foldpar {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kBF16: return "BF16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
  }
  return "?";
}

bool dtype_from_name(std::string_view name, DType* out) {
  for (DType t : {DType::kF32, DType::kF64, DType::kBF16, DType::kI32, DType::kI64}) {
    if (dtype_name(t) == name) {
      *out = t;
      return true;
    }
  }
  return false;
}

}  // namespace foldpar
