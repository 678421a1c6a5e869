// Hugging Face tokenizer.json: the BPE models of Llama 3, Qwen (byte-level, Split regexes)
// and Llama 2, Mistral, TinyLlama (byte fallback, Metaspace or Prepend+Replace), with their
// normalizers, added and special tokens and decoders. What is implemented is listed in
// docs/tokenizers.md; anything else in a file is refused by name, never skipped.
#pragma once

#include <memory>
#include <string>

#include "data/tokenizer.h"

namespace foldpar {

// Loads path (a tokenizer.json); bos/eos come from a tokenizer_config.json beside it, if
// any. not_found when the file is missing; invalid_argument, one line naming the file and
// the value, for bad JSON and for a model type, normalizer, pre-tokenizer, decoder or
// option this reader does not implement.
Result<std::unique_ptr<Tokenizer>> load_hf_tokenizer(const std::string& path);

}  // namespace foldpar
