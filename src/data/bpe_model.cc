// BpeModel: the merge table (open addressing on id pairs), the merge loop and the cache.
#include "data/bpe_model.h"

#include <algorithm>
#include <mutex>
#include <functional>

#include <fmt/format.h>

namespace foldpar {
namespace {

constexpr size_t kMaxCachedWordBytes = 64;  // longer words are rare and not worth a slot
constexpr size_t kCacheEntries = 1 << 18;   // cleared when full: bounded memory
constexpr int32_t kShortWordSymbols = 24;    // up to this many symbols: the quadratic loop

uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t{static_cast<uint32_t>(a)} << 32) | static_cast<uint32_t>(b); }

// Length of the UTF-8 sequence starting with byte c (1 for a stray continuation byte).
size_t utf8_length(unsigned char c) {
  if (c < 0xc0) return 1;
  if (c < 0xe0) return 2;
  if (c < 0xf0) return 3;
  return 4;
}

}  // namespace

// Open addressing with linear probing: ~2x the merges in slots, one multiply per probe.
struct BpeModel::MergeTable {
  struct Slot {
    uint64_t key = ~uint64_t{0};
    uint32_t rank = 0;
    int32_t merged = -1;
  };
  std::vector<Slot> slots;
  uint64_t mask = 0;

  explicit MergeTable(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    slots.resize(cap);
    mask = cap - 1;
  }
  static uint64_t hash(uint64_t key) { return (key * 0x9E3779B97F4A7C15ull) >> 20; }
  // Keeps the first (lowest-rank) entry of a pair listed twice, as Hugging Face does.
  void insert(uint64_t key, uint32_t rank, int32_t merged) {
    for (uint64_t i = hash(key) & mask;; i = (i + 1) & mask) {
      if (slots[i].key == key) return;
      if (slots[i].merged < 0) {
        slots[i] = {key, rank, merged};
        return;
      }
    }
  }
  const Slot* find(uint64_t key) const {
    for (uint64_t i = hash(key) & mask;; i = (i + 1) & mask) {
      if (slots[i].key == key) return &slots[i];
      if (slots[i].merged < 0) return nullptr;
    }
  }
};

struct BpeModel::Cache {
  std::mutex mutex;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> words;
};

Result<BpeModel> BpeModel::build(TokenMap vocab, const std::vector<std::pair<std::string, std::string>>& merges,
                                 const BpeOptions& options) {
  BpeModel m;
  m.options_ = options;
  auto table = std::make_shared<MergeTable>(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& [a, b] = merges[r];
    const auto ia = vocab.find(a), ib = vocab.find(b), im = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || im == vocab.end())
      return invalid_argument("merge {} ('{}' '{}') names a token outside the vocabulary", r, a, b);
    table->insert(pair_key(ia->second, ib->second), static_cast<uint32_t>(r), im->second);
  }
  for (int c = 0; c < 256; ++c) {
    const std::string key = options.byte_level ? std::string(1, static_cast<char>(c)) : fmt::format("<0x{:02X}>", c);
    const auto it = vocab.find(key);
    m.byte_id_[c] = it == vocab.end() ? -1 : it->second;
    if (c < 0x80) {
      const auto ascii = vocab.find(std::string(1, static_cast<char>(c)));
      m.ascii_id_[c] = ascii == vocab.end() ? -1 : ascii->second;
    }
  }
  m.vocab_ = std::move(vocab);
  m.merges_ = std::move(table);
  m.cache_ = std::make_shared<Cache>();
  return m;
}

void BpeModel::initial_symbols(std::string_view word, std::vector<int32_t>& ids) const {
  ids.clear();
  if (options_.byte_level) {
    for (unsigned char c : word) ids.push_back(byte_id_[c]);  // -1 only for a broken vocabulary
    return;
  }
  bool last_unk = false;
  for (size_t i = 0; i < word.size();) {
    const auto c0 = static_cast<unsigned char>(word[i]);
    if (c0 < 0x80 && ascii_id_[c0] >= 0) {  // the common case, without hashing
      ids.push_back(ascii_id_[c0]);
      last_unk = false;
      ++i;
      continue;
    }
    const size_t n = std::min(utf8_length(c0), word.size() - i);
    const std::string_view ch = word.substr(i, n);
    i += n;
    if (const auto it = vocab_.find(ch); it != vocab_.end()) {
      ids.push_back(it->second);
      last_unk = false;
      continue;
    }
    if (options_.byte_fallback &&
        std::all_of(ch.begin(), ch.end(), [&](char c) { return byte_id_[static_cast<unsigned char>(c)] >= 0; })) {
      for (unsigned char c : ch) ids.push_back(byte_id_[c]);
      last_unk = false;
      continue;
    }
    if (!options_.unk_id) continue;  // no unknown token: Hugging Face drops the character
    if (!(options_.fuse_unk && last_unk)) ids.push_back(*options_.unk_id);
    last_unk = true;
  }
}

// The plain form of the loop below: merge the lowest-rank adjacent pair (the leftmost of
// equal ranks) until none is left. Quadratic in the symbols, faster than the heap for the
// short words most text is made of.
void BpeModel::merge_short_word(std::vector<int32_t>& ids) const {
  while (ids.size() > 1) {
    uint32_t best_rank = UINT32_MAX;
    size_t best = 0;
    int32_t merged = -1;
    for (size_t i = 0; i + 1 < ids.size(); ++i)
      if (const MergeTable::Slot* s = merges_->find(pair_key(ids[i], ids[i + 1])); s != nullptr && s->rank < best_rank) {
        best_rank = s->rank;
        best = i;
        merged = s->merged;
      }
    if (merged < 0) return;
    ids[best] = merged;
    ids.erase(ids.begin() + static_cast<ptrdiff_t>(best) + 1);
  }
}

void BpeModel::encode_word_reference(std::string_view word, std::vector<int32_t>& out) const {
  std::vector<int32_t> ids;
  initial_symbols(word, ids);
  merge_short_word(ids);
  for (int32_t id : ids)
    if (id >= 0) out.push_back(id);
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id, prev, next;
  };
  struct Candidate {
    uint32_t rank;
    int32_t pos, left, right, merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<int32_t> ids;
  thread_local std::vector<Symbol> sym;
  thread_local std::vector<Candidate> heap;  // a min-heap on (rank, pos)
  initial_symbols(word, ids);
  const int32_t n = static_cast<int32_t>(ids.size());
  if (n <= kShortWordSymbols) {
    merge_short_word(ids);
    for (int32_t id : ids)
      if (id >= 0) out.push_back(id);
    return;
  }
  sym.resize(n);
  for (int32_t i = 0; i < n; ++i) sym[i] = {ids[i], i - 1, i + 1 < n ? i + 1 : -1};
  heap.clear();
  const auto push_pair = [&](int32_t left) {
    const int32_t right = sym[left].next;
    if (right < 0) return;
    if (const MergeTable::Slot* s = merges_->find(pair_key(sym[left].id, sym[right].id))) {
      heap.push_back({s->rank, left, sym[left].id, sym[right].id, s->merged});
      std::push_heap(heap.begin(), heap.end(), std::greater<>{});
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const Candidate c = heap.back();
    heap.pop_back();
    const int32_t right = sym[c.pos].next;
    if (sym[c.pos].id != c.left || right < 0 || sym[right].id != c.right) continue;  // stale
    sym[c.pos].id = c.merged;
    sym[c.pos].next = sym[right].next;
    if (sym[right].next >= 0) sym[sym[right].next].prev = c.pos;
    sym[right].id = -1;
    if (sym[c.pos].prev >= 0) push_pair(sym[c.pos].prev);
    push_pair(c.pos);
  }
  for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = sym[i].next)
    if (sym[i].id >= 0) out.push_back(sym[i].id);
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (options_.ignore_merges)
    if (const auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_->mutex);
    if (const auto it = cache_->words.find(word); it != cache_->words.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out.size();
  merge_word(word, out);
  if (!cacheable) return;
  std::lock_guard<std::mutex> lock(cache_->mutex);
  if (cache_->words.size() >= kCacheEntries) cache_->words.clear();
  cache_->words.emplace(std::string(word), std::vector<int32_t>(out.begin() + start, out.end()));
}

}  // namespace foldpar
