// The tokenizer.json reader without the npm oracle: what it refuses (one line naming the
// value), how make_tokenizer picks it, merges in both forms, added tokens, invalid UTF-8,
// bos/eos from tokenizer_config.json. tests/unit/hf_tokenizer_oracle_test.cc checks the
// ids on the real vocabularies.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "data/hf_tokenizer.h"
#include "data/tokenizer.h"

namespace foldpar {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("foldpar_hf_tokenizer_test_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

// A byte-fallback BPE over a few characters: "a", "b", "ab", "▁", "▁ab", the <0xNN>
// tokens, and the added token "<x>".
json small_tokenizer() {
  json vocab = {{"<unk>", 0}, {"a", 1}, {"b", 2}, {"ab", 3}, {"\u2581", 4}, {"\u2581ab", 5}};
  for (int c = 0; c < 256; ++c) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", c);
    vocab[name] = 6 + c;
  }
  return {{"model",
           {{"type", "BPE"}, {"unk_token", "<unk>"}, {"byte_fallback", true}, {"vocab", vocab},
            {"merges", json::array({"a b", "\u2581 ab"})}}},
          {"normalizer",
           {{"type", "Sequence"},
            {"normalizers", json::array({{{"type", "Prepend"}, {"prepend", "\u2581"}},
                                         {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}})}}},
          {"pre_tokenizer", nullptr},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders", json::array({{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
                                      {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
          {"added_tokens", json::array({{{"id", 262}, {"content", "<x>"}, {"special", true}}})}};
}

fs::path write(const fs::path& dir, const json& j, const std::string& name = "tokenizer.json") {
  fs::create_directories(dir);
  std::ofstream(dir / name) << j.dump();
  return dir / name;
}

// The load must fail with invalid_argument, one line, naming every needle.
void expect_refused(const json& j, const std::vector<std::string>& needles) {
  TempDir dir;
  Result<std::unique_ptr<Tokenizer>> tok = load_hf_tokenizer(write(dir.path, j).string());
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kInvalidArgument);
  const std::string m = tok.status().message();
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  for (const std::string& n : needles) EXPECT_NE(m.find(n), std::string::npos) << "'" << n << "' not in: " << m;
}

TEST(HfTokenizer, RefusesWhatItDoesNotImplementByName) {
  for (const char* type : {"WordPiece", "Unigram", "WordLevel"}) {
    json j = small_tokenizer();
    j["model"]["type"] = type;
    expect_refused(j, {"model type", type, "tokenizer.json"});
  }
  json j = small_tokenizer();
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_refused(j, {"pre_tokenizer", "Whitespace"});
  j = small_tokenizer();
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({{{"type", "Digits"}}})}};
  expect_refused(j, {"pre_tokenizer", "Digits"});
  j = small_tokenizer();
  j["normalizer"] = {{"type", "NFKC"}};
  expect_refused(j, {"normalizer", "NFKC"});
  j = small_tokenizer();
  j["decoder"] = {{"type", "WordPiece"}};
  expect_refused(j, {"decoder", "WordPiece"});
  j = small_tokenizer();
  j["model"]["dropout"] = 0.1;
  expect_refused(j, {"dropout"});
  j = small_tokenizer();
  j["added_tokens"][0]["lstrip"] = true;
  expect_refused(j, {"<x>", "lstrip"});
  j = small_tokenizer();
  j["model"]["merges"].push_back("a zz");
  expect_refused(j, {"merge 2", "zz"});
  j = small_tokenizer();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  expect_refused(j, {"(unclosed"});
}

TEST(HfTokenizer, BadFilesAreErrorsNamingThePath) {
  TempDir dir;
  Result<std::unique_ptr<Tokenizer>> missing = make_tokenizer((dir.path / "none.json").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("none.json"), std::string::npos);
  std::ofstream(dir.path / "broken.json") << "{\"model\": ";
  Result<std::unique_ptr<Tokenizer>> broken = make_tokenizer((dir.path / "broken.json").string());
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("broken.json"), std::string::npos);
}

TEST(HfTokenizer, EncodesMergesAddedTokensAndByteFallback) {
  TempDir dir;
  Result<std::unique_ptr<Tokenizer>> tok = make_tokenizer(write(dir.path, small_tokenizer()).string());
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EXPECT_EQ((*tok)->vocab_size(), 263u);
  EXPECT_EQ((*tok)->describe(), "hf:" + (dir.path / "tokenizer.json").string());
  // "ab a" -> "▁ab▁a": merge "a b" (rank 0) then "▁ ab" (rank 1); the second "a" stays.
  EXPECT_EQ((*tok)->encode("ab a"), (std::vector<int32_t>{5, 4, 1}));
  // <x> is split out first; the text after it gets its own "▁" (Prepend per piece).
  EXPECT_EQ((*tok)->encode("ab<x>ab"), (std::vector<int32_t>{5, 262, 5}));
  // "c" is not in the vocabulary: its byte token <0x63>.
  EXPECT_EQ((*tok)->encode("c"), (std::vector<int32_t>{4, 6 + 0x63}));
  EXPECT_EQ((*tok)->decode((*tok)->encode("ab a c")), "ab a c");
  EXPECT_EQ((*tok)->decode((*tok)->encode("é")), "é");
  // Invalid UTF-8 is read as U+FFFD, as decoding the bytes lossily would.
  EXPECT_EQ((*tok)->encode("a\xff"), (*tok)->encode("a\xef\xbf\xbd"));
  EXPECT_FALSE((*tok)->bos_id().has_value());
}

TEST(HfTokenizer, MergesAsStringsOrPairsGiveTheSameIds) {
  TempDir dir;
  json pairs = small_tokenizer();
  pairs["model"]["merges"] = json::array({json::array({"a", "b"}), json::array({"\u2581", "ab"})});
  Result<std::unique_ptr<Tokenizer>> a = make_tokenizer(write(dir.path / "s", small_tokenizer()).string());
  Result<std::unique_ptr<Tokenizer>> b = make_tokenizer(write(dir.path / "p", pairs).string());
  ASSERT_TRUE(a.ok() && b.ok());
  for (const char* text : {"ab a", "abab ab", "ba<x>ab", "xyz"}) EXPECT_EQ((*a)->encode(text), (*b)->encode(text));
}

TEST(HfTokenizer, BosAndEosComeFromTokenizerConfig) {
  TempDir dir;
  json j = small_tokenizer();
  write(dir.path, j);
  write(dir.path, {{"bos_token", {{"content", "<x>"}}}, {"eos_token", "<unk>"}}, "tokenizer_config.json");
  Result<std::unique_ptr<Tokenizer>> tok = make_tokenizer(dir.path.string());  // a directory: its tokenizer.json
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EXPECT_EQ((*tok)->bos_id(), std::optional<int32_t>(262));
  EXPECT_EQ((*tok)->eos_id(), std::optional<int32_t>(0));
  EXPECT_EQ((*tok)->encode("<x>"), (std::vector<int32_t>{262}));
}

TEST(HfTokenizer, AModelDirectoryImpliesItsTokenizerJson) {
  TempDir dir;
  EXPECT_EQ(default_tokenizer_spec("", dir.path.string()), "");  // no tokenizer.json: bytes
  write(dir.path, small_tokenizer());
  EXPECT_EQ(default_tokenizer_spec("", dir.path.string()), (dir.path / "tokenizer.json").string());
  EXPECT_EQ(default_tokenizer_spec("bytes", dir.path.string()), "bytes");  // an explicit choice wins
  EXPECT_EQ(default_tokenizer_spec("", ""), "");
}

}  // namespace
}  // namespace foldpar
