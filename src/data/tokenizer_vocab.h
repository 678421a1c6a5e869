// The vocabulary of a Hugging Face byte-level BPE tokenizer.json (Llama 3, Qwen) as plain
// lists, for writers of other formats (the GGUF export): tokens by id in their byte-level
// spelling, which ids are added (special or not), the merges in rank order, and the Split
// pre-tokenizer's regex. Encoding lives in data/hf_tokenizer.h; this only reads the file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace foldpar {

struct ByteLevelBpeVocab {
  enum class Kind : uint8_t { kNormal, kSpecial, kAdded, kMissing };  // kMissing: an id no entry names
  std::vector<std::string> tokens;  // by id, dense from 0 (a missing id's text is "")
  std::vector<Kind> kinds;
  std::vector<std::string> merges;  // "a b", rank order
  std::string split_regex;          // the pattern of the Split pre-tokenizer
};

// invalid_argument naming the file and what it holds for anything but a BPE model without
// byte fallback behind a Sequence of a Split (regex) and a ByteLevel pre-tokenizer.
Result<ByteLevelBpeVocab> read_byte_level_bpe_vocab(const std::string& tokenizer_json);

}  // namespace foldpar
