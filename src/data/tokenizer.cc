// Byte and SentencePiece tokenizers, and the choice between them and tokenizer.json.
#include "data/tokenizer.h"

#include <sentencepiece_processor.h>

#include <filesystem>

#include "data/hf_tokenizer.h"

namespace foldpar {
namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  uint32_t vocab_size() const override { return 256; }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(std::span<const int32_t> ids) const override {
    std::string text;
    text.reserve(ids.size());
    for (int32_t id : ids) text.push_back(static_cast<char>(id & 0xff));
    return text;
  }
  std::string describe() const override { return "bytes"; }
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(std::string path, std::unique_ptr<sentencepiece::SentencePieceProcessor> sp)
      : path_(std::move(path)), sp_(std::move(sp)) {}
  uint32_t vocab_size() const override { return static_cast<uint32_t>(sp_->GetPieceSize()); }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    sp_->Encode(text, &ids).IgnoreError();  // encoding valid UTF-8 cannot fail; invalid bytes map to unk
    return std::vector<int32_t>(ids.begin(), ids.end());
  }
  std::string decode(std::span<const int32_t> ids) const override {
    std::string text;
    sp_->Decode(std::vector<int>(ids.begin(), ids.end()), &text).IgnoreError();
    return text;
  }
  std::string describe() const override { return "sentencepiece:" + path_; }

 private:
  std::string path_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

Result<std::unique_ptr<Tokenizer>> load_sentencepiece_tokenizer(const std::string& path) {
  if (!std::filesystem::is_regular_file(path)) return not_found("SentencePiece model '{}' does not exist", path);
  auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
  const auto status = sp->Load(path);
  if (!status.ok()) return invalid_argument("cannot load SentencePiece model '{}': {}", path, status.ToString());
  return std::unique_ptr<Tokenizer>(std::make_unique<SentencePieceTokenizer>(path, std::move(sp)));
}

Result<std::unique_ptr<Tokenizer>> make_tokenizer(const std::string& spec) {
  if (spec.empty() || spec == "bytes") return make_byte_tokenizer();
  if (spec.starts_with("sentencepiece:")) return load_sentencepiece_tokenizer(spec.substr(14));
  if (spec.starts_with("hf:")) return load_hf_tokenizer(spec.substr(3));
  if (spec.ends_with(".json")) return load_hf_tokenizer(spec);
  if (std::filesystem::is_directory(spec)) return load_hf_tokenizer((std::filesystem::path(spec) / "tokenizer.json").string());
  return load_sentencepiece_tokenizer(spec);
}

std::string default_tokenizer_spec(const std::string& spec, const std::string& model_dir) {
  if (!spec.empty() || model_dir.empty()) return spec;
  const std::filesystem::path json = std::filesystem::path(model_dir) / "tokenizer.json";
  return std::filesystem::is_regular_file(json) ? json.string() : "";
}

}  // namespace foldpar
