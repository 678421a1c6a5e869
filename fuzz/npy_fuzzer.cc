// libFuzzer target: fuzz::run_npy (fuzz/fuzz_readers.h) on every input.
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_readers.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  foldpar::fuzz::run_npy(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
