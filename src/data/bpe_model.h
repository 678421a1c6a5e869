// Byte-pair encoding of one pre-tokenized word over token ids: the merge ranks of a
// Hugging Face BPE model as a hash map on id pairs, the lowest rank merged first (leftmost
// on ties, as Hugging Face's priority queue does), and a bounded per-word cache.
// Byte-level models are held in raw bytes: their vocabulary strings are mapped back
// through GPT-2's byte-to-character table at load, so a word's first symbols are its bytes.
// Other models start from UTF-8 characters; a character outside the vocabulary becomes its
// <0xNN> byte tokens (byte_fallback) or the unknown token (fused when fuse_unk).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/status.h"

namespace foldpar {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct BpeOptions {
  bool byte_level = false;     // symbols start as raw bytes (vocabulary in raw bytes)
  bool byte_fallback = false;  // unknown characters -> <0xNN> tokens
  bool fuse_unk = false;       // consecutive unknown characters -> one unknown token
  bool ignore_merges = false;  // a word that is itself in the vocabulary is one token
  std::optional<int32_t> unk_id;
};

class BpeModel {
 public:
  // vocab: token -> id (raw bytes when byte_level); merges: token pairs, rank = index.
  // invalid_argument naming the merge when a merge names a token outside the vocabulary.
  static Result<BpeModel> build(TokenMap vocab, const std::vector<std::pair<std::string, std::string>>& merges,
                                const BpeOptions& options);

  // Appends the ids of word (non-empty, valid UTF-8 unless byte_level) to out.
  // Thread-safe (the cache is locked).
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  // The plain form, for tests: the quadratic merge loop on any word, no cache, no
  // ignore_merges. encode_word must give the same ids (tests/unit/bpe_model_test.cc).
  void encode_word_reference(std::string_view word, std::vector<int32_t>& out) const;

  const TokenMap& vocab() const { return vocab_; }

 private:
  struct MergeTable;
  struct Cache;
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;
  void merge_short_word(std::vector<int32_t>& ids) const;
  void initial_symbols(std::string_view word, std::vector<int32_t>& ids) const;

  TokenMap vocab_;
  BpeOptions options_;
  std::shared_ptr<const MergeTable> merges_;
  std::shared_ptr<Cache> cache_;
  int32_t byte_id_[256];   // byte_level: the id of each single byte (-1: none); else <0xNN>
  int32_t ascii_id_[128];  // the id of each one-character ASCII token (-1: none)
};

}  // namespace foldpar
