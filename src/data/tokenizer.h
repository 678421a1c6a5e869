// Tokenizers: text <-> token ids. Bytes by default (vocabulary 256: ids are the UTF-8
// bytes); a SentencePiece model (libsentencepiece) or a Hugging Face tokenizer.json
// (data/hf_tokenizer.h) when one is given.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
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
  // "bytes", "sentencepiece:<path>" or "hf:<path>": what data.json records.
  virtual std::string describe() const = 0;
  // The beginning- and end-of-text tokens, where the tokenizer names them (tokenizer.json:
  // tokenizer_config.json's bos_token / eos_token). encode() never adds them.
  virtual std::optional<int32_t> bos_id() const { return std::nullopt; }
  virtual std::optional<int32_t> eos_id() const { return std::nullopt; }
};

std::unique_ptr<Tokenizer> make_byte_tokenizer();
// not_found / invalid_argument naming the path when the model cannot be loaded.
Result<std::unique_ptr<Tokenizer>> load_sentencepiece_tokenizer(const std::string& model_path);
// "" or "bytes": the byte tokenizer; a path ending in ".json" (or "hf:<path>"): a Hugging
// Face tokenizer.json; a directory: its tokenizer.json; anything else: a SentencePiece
// model path ("sentencepiece:<path>" also).
Result<std::unique_ptr<Tokenizer>> make_tokenizer(const std::string& spec);
// The tokenizer a model directory implies when none is given: model_dir/tokenizer.json
// when it exists, else "" (bytes). spec when spec is not empty.
std::string default_tokenizer_spec(const std::string& spec, const std::string& model_dir);

}  // namespace foldpar
