// Tokenizers: text <-> token ids. Bytes by default (vocabulary 256: ids are the UTF-8
// bytes); a SentencePiece model (libsentencepiece) when one is given.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace foldpar {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual uint32_t vocab_size() const = 0;
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  // "bytes" or "sentencepiece:<path>": what data.json records.
  virtual std::string describe() const = 0;
};

std::unique_ptr<Tokenizer> make_byte_tokenizer();
// not_found / invalid_argument naming the path when the model cannot be loaded.
Result<std::unique_ptr<Tokenizer>> load_sentencepiece_tokenizer(const std::string& model_path);
// "" or "bytes": the byte tokenizer; anything else: a SentencePiece model path.
Result<std::unique_ptr<Tokenizer>> make_tokenizer(const std::string& spec);

}  // namespace foldpar
