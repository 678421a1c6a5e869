// Token files: a corpus turned into token ids (`foldpar prepare-data`).
// Layout, little-endian: 32-byte header, then `count` ids of `width` bytes each:
//   bytes 0-7   magic "FPTOKENS"
//   bytes 8-11  u32 version (1)
//   bytes 12-15 u32 vocab_size   every id is below it
//   bytes 16-19 u32 width        bytes per id: 1, 2 or 4
//   bytes 20-23 u32 reserved (0)
//   bytes 24-31 u64 count
// The reader checks the header against the file size before allocating anything, and every
// id against the vocabulary: a malformed file is a kCorrupt Status, never a crash.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace foldpar {

struct TokenFile {
  uint32_t vocab_size = 0;
  std::vector<int32_t> ids;
};

constexpr uint64_t kTokenFileHeaderBytes = 32;

// The smallest width that holds ids below vocab_size.
uint32_t token_width_for(uint32_t vocab_size);

// Validates a whole file's bytes (pure, for the fuzzer and the reader).
Result<TokenFile> parse_token_file(std::string_view bytes);
Result<TokenFile> read_token_file(const std::string& path);
// Atomic (io/atomic_file.h). invalid_argument for an id outside [0, vocab_size).
Status write_token_file(const std::string& path, uint32_t vocab_size, const std::vector<int32_t>& ids);

}  // namespace foldpar
