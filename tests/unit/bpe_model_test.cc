// BpeModel's fast path (a heap of candidate merges for long words, the word cache) against
// its plain quadratic loop, on random merge tables and random words of every length.
#include <gtest/gtest.h>

#include <random>

#include "data/bpe_model.h"

namespace foldpar {
namespace {

// A random BPE over a four-letter alphabet: each merge joins two existing tokens.
Result<BpeModel> random_model(std::mt19937& rng, bool byte_level) {
  TokenMap vocab;
  std::vector<std::string> tokens = {"a", "b", "c", "d"};
  for (const std::string& t : tokens) vocab.emplace(t, static_cast<int32_t>(vocab.size()));
  std::vector<std::pair<std::string, std::string>> merges;
  while (merges.size() < 300) {
    const std::string& x = tokens[rng() % tokens.size()];
    const std::string& y = tokens[rng() % tokens.size()];
    if (x.size() + y.size() > 8 || vocab.count(x + y)) continue;
    merges.emplace_back(x, y);
    vocab.emplace(x + y, static_cast<int32_t>(vocab.size()));
    tokens.push_back(x + y);
  }
  BpeOptions o;
  o.byte_level = byte_level;
  return BpeModel::build(std::move(vocab), merges, o);
}

TEST(BpeModel, HeapAndCacheGiveThePlainLoopsIds) {
  std::mt19937 rng(7);
  for (bool byte_level : {false, true}) {
    for (int table = 0; table < 5; ++table) {
      Result<BpeModel> m = random_model(rng, byte_level);
      ASSERT_TRUE(m.ok()) << m.status().to_string();
      for (int w = 0; w < 400; ++w) {
        const size_t n = 1 + rng() % (w < 200 ? 30 : 300);  // both sides of the short-word cut
        std::string word;
        for (size_t i = 0; i < n; ++i) word.push_back("abcd"[rng() % 4]);
        std::vector<int32_t> fast, again, plain;
        m->encode_word(word, fast);
        m->encode_word(word, again);  // from the cache when short
        m->encode_word_reference(word, plain);
        ASSERT_EQ(fast, plain) << word;
        ASSERT_EQ(again, plain) << word;
      }
    }
  }
}

}  // namespace
}  // namespace foldpar
