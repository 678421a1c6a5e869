// Token streams other tools produce, read as token ids for `foldpar prepare-data`: raw
// little-endian arrays of uint16 or uint32 (".bin", the width stated by the user, as
// nanoGPT and llm.c write them) and NumPy ".npy" arrays (format versions 1-3; descr '<u2',
// '<u4', '<i4', '<i8' or '<u8', C order, any shape, read flat). Every id is checked against
// the vocabulary; errors name the file, the byte offset and the value. Nothing here splits
// documents (data/corpus.h does).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace foldpar {

enum class TokenInputFormat { kText, kBinU16, kBinU32, kNpy };
// "text", "bin-u16", "bin-u32" or "npy"; invalid_argument naming the others.
Result<TokenInputFormat> token_input_format_from_name(const std::string& name);
std::string token_input_format_name(TokenInputFormat f);

// What an .npy header says about the array that follows it.
struct NpyHeader {
  int width = 0;              // bytes per element: 2, 4 or 8
  bool is_signed = false;     // '<i4', '<i8'
  uint64_t count = 0;         // product of the shape
  uint64_t data_offset = 0;   // where the elements start
};
// Parses the magic, version and header dict at the start of `bytes`; kCorrupt naming what is
// wrong (bad magic, unknown version, a header that is not a dict), invalid_argument for a
// valid file this reader does not take (another descr, big-endian, fortran_order True).
// `name` prefixes the messages.
Result<NpyHeader> parse_npy_header(std::string_view bytes, const std::string& name);

// Decodes a whole file's bytes into ids below vocab_size (kCorrupt: truncated data, a byte
// count that is not a multiple of the width; invalid_argument: an id >= vocab_size or
// negative, naming the byte offset and value). `format` is not kText.
Result<std::vector<int32_t>> decode_token_stream(std::string_view bytes, TokenInputFormat format,
                                                 uint32_t vocab_size, const std::string& name);
Result<std::vector<int32_t>> read_token_stream(const std::string& path, TokenInputFormat format, uint32_t vocab_size);

}  // namespace foldpar
