// HfTokenizer: tokenizer.json parsed into normalizer / pre-tokenizer / decoder steps
// around a BpeModel. encode() is Hugging Face's encode(text, add_special_tokens=False):
// added tokens are split out first (leftmost, longest first, on the raw text), then each
// piece between them is normalized, pre-tokenized and byte-pair encoded. The post-processor
// (a BOS in front) is not applied: callers that want it use bos_id().
#include "data/hf_tokenizer.h"

#include <unicode/normalizer2.h>
#include <unicode/bytestream.h>

#include <algorithm>
#include <array>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "data/bpe_model.h"
#include "data/regex_split.h"

namespace foldpar {
namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer regex: what ByteLevel(use_regex=true) splits with.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kSpacePiece = "\xe2\x96\x81";  // U+2581, SentencePiece's space

// Length of the valid UTF-8 sequence at s[i], or 0 if it is not one (overlong, surrogate,
// above U+10FFFF, truncated): the same rules as Rust's str.
size_t valid_utf8_at(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  const auto cont = [&](size_t k) { return k < s.size() && (b(k) & 0xc0) == 0x80; };
  if (c >= 0xc2 && c <= 0xdf) return cont(i + 1) ? 2 : 0;
  if (c >= 0xe0 && c <= 0xef) {
    if (!cont(i + 1) || !cont(i + 2)) return 0;
    if (c == 0xe0 && b(i + 1) < 0xa0) return 0;
    if (c == 0xed && b(i + 1) > 0x9f) return 0;
    return 3;
  }
  if (c >= 0xf0 && c <= 0xf4) {
    if (!cont(i + 1) || !cont(i + 2) || !cont(i + 3)) return 0;
    if (c == 0xf0 && b(i + 1) < 0x90) return 0;
    if (c == 0xf4 && b(i + 1) > 0x8f) return 0;
    return 4;
  }
  return 0;
}

// text with every invalid byte replaced by U+FFFD; empty optional when text is valid.
std::optional<std::string> replace_invalid_utf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    if (static_cast<unsigned char>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = valid_utf8_at(text, i);
    if (n == 0) break;
    i += n;
  }
  if (i == text.size()) return std::nullopt;
  std::string out(text.substr(0, i));
  while (i < text.size()) {
    const size_t n = valid_utf8_at(text, i);
    if (n == 0) {
      out += "\xef\xbf\xbd";
      ++i;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

// GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the other
// 68 bytes for U+0100.. in byte order. Returns the inverse as a map from code point.
std::map<char32_t, unsigned char> char_to_byte_table() {
  std::map<char32_t, unsigned char> inverse;
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    inverse[printable ? static_cast<char32_t>(b) : next++] = static_cast<unsigned char>(b);
  }
  return inverse;
}

// The raw bytes a byte-level token stands for; nullopt when a character is not in the table.
std::optional<std::string> byte_level_to_raw(std::string_view token, const std::map<char32_t, unsigned char>& table) {
  std::string raw;
  for (size_t i = 0; i < token.size();) {
    const size_t n = valid_utf8_at(token, i);
    if (n == 0) return std::nullopt;
    const auto b = [&](size_t k) { return static_cast<unsigned char>(token[i + k]); };
    char32_t c = n == 1 ? b(0) : n == 2 ? ((b(0) & 0x1f) << 6) | (b(1) & 0x3f)
                 : n == 3 ? ((b(0) & 0x0f) << 12) | ((b(1) & 0x3f) << 6) | (b(2) & 0x3f)
                          : ((b(0) & 0x07) << 18) | ((b(1) & 0x3f) << 12) | ((b(2) & 0x3f) << 6) | (b(3) & 0x3f);
    const auto it = table.find(c);
    if (it == table.end()) return std::nullopt;
    raw.push_back(static_cast<char>(it->second));
    i += n;
  }
  return raw;
}

// Every occurrence of from replaced by to, in one pass (linear in the text).
void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  size_t pos = s.find(from);
  if (pos == std::string::npos) return;
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  size_t begin = 0;
  for (; pos != std::string::npos; pos = s.find(from, begin)) {
    out.append(s, begin, pos - begin).append(to);
    begin = pos + from.size();
  }
  out.append(s, begin);
  s = std::move(out);
}

enum class PrependScheme { kAlways, kFirst, kNever };

struct NormalizerStep {
  enum class Kind { kNfc, kPrepend, kReplace } kind;
  std::string from, to;  // kPrepend: to; kReplace: from -> to
};

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel, kMetaspace } kind = Kind::kSplit;
  std::optional<RegexSplit> regex;  // kSplit; kByteLevel with use_regex
  bool add_prefix_space = false;    // kByteLevel
  std::string replacement;          // kMetaspace
  PrependScheme prepend = PrependScheme::kAlways;
  bool split = true;  // kMetaspace: a piece per replacement character
};

struct DecoderStep {
  enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind = Kind::kByteLevel;
  std::string from, to;      // kReplace; kMetaspace: from = replacement
  std::string content;       // kStrip: the character stripped
  size_t start = 0, stop = 0;  // kStrip
  PrependScheme prepend = PrependScheme::kAlways;
};

DecoderStep decoder_step(DecoderStep::Kind kind) {
  DecoderStep d;
  d.kind = kind;
  return d;
}

struct AddedToken {
  std::string content;
  int32_t id;
};

// Parsing: each returns the steps or one line naming what is not implemented.
class Parser {
 public:
  explicit Parser(std::string path) : path_(std::move(path)) {}

  Status refuse(std::string_view what, std::string_view name, std::string_view implemented) const {
    return invalid_argument("tokenizer '{}': {} '{}' is not implemented (implemented: {})", path_, what, name,
                            implemented);
  }
  static std::string type_of(const json& j) { return j.is_object() ? j.value("type", std::string("?")) : "?"; }

  // Split and Replace patterns: {"String": s} or {"Regex": r}.
  Result<std::pair<std::string, bool>> pattern(const json& j, std::string_view where) const {
    if (j.contains("String")) return std::pair{j["String"].get<std::string>(), true};
    if (j.contains("Regex")) return std::pair{j["Regex"].get<std::string>(), false};
    return invalid_argument("tokenizer '{}': {} pattern {} is neither String nor Regex", path_, where, j.dump());
  }

  Result<std::vector<NormalizerStep>> normalizer(const json& j) const {
    std::vector<NormalizerStep> steps;
    if (j.is_null()) return steps;
    const std::string type = type_of(j);
    if (type == "Sequence") {
      for (const json& n : j.at("normalizers")) {
        FP_ASSIGN_OR_RETURN(std::vector<NormalizerStep> inner, normalizer(n));
        steps.insert(steps.end(), inner.begin(), inner.end());
      }
    } else if (type == "NFC") {
      steps.push_back({NormalizerStep::Kind::kNfc, "", ""});
    } else if (type == "Prepend") {
      steps.push_back({NormalizerStep::Kind::kPrepend, "", j.at("prepend").get<std::string>()});
    } else if (type == "Replace") {
      FP_ASSIGN_OR_RETURN(auto p, pattern(j.at("pattern"), "Replace normalizer"));
      if (!p.second) return refuse("normalizer Replace with a Regex pattern", p.first, "String patterns");
      steps.push_back({NormalizerStep::Kind::kReplace, p.first, j.at("content").get<std::string>()});
    } else {
      return refuse("normalizer", type, "NFC, Prepend, Replace, Sequence");
    }
    return steps;
  }

  static PrependScheme metaspace_scheme(const json& j) {
    if (j.contains("add_prefix_space") && j["add_prefix_space"].is_boolean() && !j["add_prefix_space"].get<bool>())
      return PrependScheme::kNever;
    const std::string s = j.value("prepend_scheme", std::string("always"));
    return s == "first" ? PrependScheme::kFirst : s == "never" ? PrependScheme::kNever : PrependScheme::kAlways;
  }

  Result<std::vector<PreTokenizerStep>> pre_tokenizer(const json& j) const {
    std::vector<PreTokenizerStep> steps;
    if (j.is_null()) return steps;
    const std::string type = type_of(j);
    if (type == "Sequence") {
      for (const json& p : j.at("pretokenizers")) {
        FP_ASSIGN_OR_RETURN(std::vector<PreTokenizerStep> inner, pre_tokenizer(p));
        for (auto& s : inner) steps.push_back(std::move(s));
      }
    } else if (type == "Split") {
      FP_ASSIGN_OR_RETURN(auto p, pattern(j.at("pattern"), "Split"));
      const std::string behavior = j.value("behavior", std::string("Isolated"));
      if (behavior != "Isolated" && behavior != "Removed") return refuse("Split behavior", behavior, "Isolated, Removed");
      if (j.value("invert", false)) return refuse("Split option", "invert: true", "invert: false");
      FP_ASSIGN_OR_RETURN(RegexSplit re, RegexSplit::compile(p.first, p.second,
                                                             behavior == "Removed" ? RegexSplit::Behavior::kRemoved
                                                                                   : RegexSplit::Behavior::kIsolated));
      PreTokenizerStep s;
      s.kind = PreTokenizerStep::Kind::kSplit;
      s.regex = std::move(re);
      steps.push_back(std::move(s));
    } else if (type == "ByteLevel") {
      PreTokenizerStep s;
      s.kind = PreTokenizerStep::Kind::kByteLevel;
      s.add_prefix_space = j.value("add_prefix_space", false);
      if (j.value("use_regex", true)) {
        FP_ASSIGN_OR_RETURN(RegexSplit re, RegexSplit::compile(kGpt2Pattern, false, RegexSplit::Behavior::kIsolated));
        s.regex = std::move(re);
      }
      steps.push_back(std::move(s));
    } else if (type == "Metaspace") {
      PreTokenizerStep s;
      s.kind = PreTokenizerStep::Kind::kMetaspace;
      s.replacement = j.value("replacement", std::string(kSpacePiece));
      s.prepend = metaspace_scheme(j);
      s.split = j.value("split", true);
      steps.push_back(std::move(s));
    } else {
      return refuse("pre_tokenizer", type, "ByteLevel, Split, Metaspace, Sequence");
    }
    return steps;
  }

  Result<std::vector<DecoderStep>> decoder(const json& j) const {
    std::vector<DecoderStep> steps;
    if (j.is_null()) return refuse("decoder", "null", "ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence");
    const std::string type = type_of(j);
    if (type == "Sequence") {
      for (const json& d : j.at("decoders")) {
        FP_ASSIGN_OR_RETURN(std::vector<DecoderStep> inner, decoder(d));
        steps.insert(steps.end(), inner.begin(), inner.end());
      }
    } else if (type == "ByteLevel") {
      steps.push_back(decoder_step(DecoderStep::Kind::kByteLevel));
    } else if (type == "Replace") {
      FP_ASSIGN_OR_RETURN(auto p, pattern(j.at("pattern"), "Replace decoder"));
      if (!p.second) return refuse("decoder Replace with a Regex pattern", p.first, "String patterns");
      DecoderStep s;
      s.kind = DecoderStep::Kind::kReplace;
      s.from = p.first;
      s.to = j.at("content").get<std::string>();
      steps.push_back(s);
    } else if (type == "ByteFallback") {
      steps.push_back(decoder_step(DecoderStep::Kind::kByteFallback));
    } else if (type == "Fuse") {
      steps.push_back(decoder_step(DecoderStep::Kind::kFuse));
    } else if (type == "Strip") {
      DecoderStep s;
      s.kind = DecoderStep::Kind::kStrip;
      s.content = j.at("content").get<std::string>();
      s.start = j.value("start", size_t{0});
      s.stop = j.value("stop", size_t{0});
      steps.push_back(s);
    } else if (type == "Metaspace") {
      DecoderStep s;
      s.kind = DecoderStep::Kind::kMetaspace;
      s.from = j.value("replacement", std::string(kSpacePiece));
      s.prepend = metaspace_scheme(j);
      steps.push_back(s);
    } else {
      return refuse("decoder", type, "ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence");
    }
    return steps;
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class HfTokenizer final : public Tokenizer {
 public:
  struct Parts {
    std::string path;
    std::vector<NormalizerStep> normalizers;
    std::vector<PreTokenizerStep> pre_tokenizers;
    std::vector<DecoderStep> decoders;
    bool byte_level = false;
    std::optional<BpeModel> bpe;
    std::vector<std::string> id_to_token;  // the vocabulary (raw bytes when byte_level)
    std::vector<AddedToken> added;
    std::optional<int32_t> bos, eos;
    // Non-byte-level models whose vocabulary has no token with U+2581 after another
    // character: no merge can cross the start of a U+2581 run, so pieces are cut there
    // before BPE (same ids; words stay short and cacheable instead of a whole text).
    bool cut_at_space_pieces = false;
  };

  explicit HfTokenizer(Parts p) : p_(std::move(p)) {
    for (const AddedToken& a : p_.added) {
      if (a.content.empty()) continue;
      by_first_byte_[static_cast<unsigned char>(a.content[0])].push_back(&a);
      added_by_id_[a.id] = &a;
    }
    for (auto& bucket : by_first_byte_)  // longest first: leftmost-longest matching
      std::stable_sort(bucket.begin(), bucket.end(),
                       [](const AddedToken* x, const AddedToken* y) { return x->content.size() > y->content.size(); });
    vocab_size_ = static_cast<uint32_t>(p_.id_to_token.size());
    for (const AddedToken& a : p_.added) vocab_size_ = std::max(vocab_size_, static_cast<uint32_t>(a.id) + 1);
  }

  uint32_t vocab_size() const override { return vocab_size_; }
  std::string describe() const override { return "hf:" + p_.path; }
  std::optional<int32_t> bos_id() const override { return p_.bos; }
  std::optional<int32_t> eos_id() const override { return p_.eos; }

  std::vector<int32_t> encode(std::string_view text) const override {
    const std::optional<std::string> clean = replace_invalid_utf8(text);
    if (clean) text = *clean;
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3);
    size_t segment = 0;
    for (size_t i = 0; i < text.size();) {
      const AddedToken* hit = nullptr;
      for (const AddedToken* a : by_first_byte_[static_cast<unsigned char>(text[i])])
        if (text.compare(i, a->content.size(), a->content) == 0) {
          hit = a;
          break;
        }
      if (hit == nullptr) {
        ++i;
        continue;
      }
      encode_segment(text.substr(segment, i - segment), segment == 0, ids);
      ids.push_back(hit->id);
      i += hit->content.size();
      segment = i;
    }
    encode_segment(text.substr(segment), segment == 0, ids);
    return ids;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
      if (const auto it = added_by_id_.find(id); it != added_by_id_.end()) {
        tokens.push_back(it->second->content);
      } else if (id >= 0 && static_cast<size_t>(id) < p_.id_to_token.size()) {
        tokens.push_back(p_.id_to_token[id]);
      }  // ids outside the vocabulary decode to nothing
    }
    for (const DecoderStep& d : p_.decoders) apply_decoder(d, tokens);
    std::string text;
    for (const std::string& t : tokens) text += t;
    return text;
  }

 private:
  void normalize(std::string& s) const {
    for (const NormalizerStep& n : p_.normalizers) {
      switch (n.kind) {
        case NormalizerStep::Kind::kNfc: {
          if (std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; })) break;
          UErrorCode err = U_ZERO_ERROR;
          const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(err);
          std::string out;
          icu::StringByteSink<std::string> sink(&out);
          if (U_SUCCESS(err)) nfc->normalizeUTF8(0, icu::StringPiece(s.data(), static_cast<int32_t>(s.size())), sink, nullptr, err);
          FP_CHECK(U_SUCCESS(err), "ICU NFC normalization failed: {}", u_errorName(err));
          s = std::move(out);
          break;
        }
        case NormalizerStep::Kind::kPrepend:
          if (!s.empty()) s.insert(0, n.to);
          break;
        case NormalizerStep::Kind::kReplace:
          replace_all(s, n.from, n.to);
          break;
      }
    }
  }

  // One pre-tokenizer step over every piece; transformed text lives in arena.
  void pre_tokenize(const PreTokenizerStep& step, bool at_start, std::vector<std::string_view>& pieces,
                    std::deque<std::string>& arena) const {
    std::vector<std::string_view> out;
    out.reserve(pieces.size());
    for (size_t k = 0; k < pieces.size(); ++k) {
      std::string_view piece = pieces[k];
      switch (step.kind) {
        case PreTokenizerStep::Kind::kSplit:
          step.regex->split(piece, out);
          break;
        case PreTokenizerStep::Kind::kByteLevel:
          if (step.add_prefix_space && !piece.starts_with(' ')) piece = arena.emplace_back(std::string(1, ' ').append(piece));
          if (step.regex) {
            step.regex->split(piece, out);
          } else {
            out.push_back(piece);
          }
          break;
        case PreTokenizerStep::Kind::kMetaspace: {
          std::string& s = arena.emplace_back(piece);
          replace_all(s, " ", step.replacement);
          const bool prepend = step.prepend == PrependScheme::kAlways ||
                               (step.prepend == PrependScheme::kFirst && at_start && k == 0);
          if (prepend && !s.starts_with(step.replacement)) s.insert(0, step.replacement);
          const std::string_view v = s;
          if (!step.split) {
            if (!v.empty()) out.push_back(v);
            break;
          }
          size_t begin = 0;
          for (size_t pos = v.find(step.replacement, 1); pos != std::string_view::npos;
               pos = v.find(step.replacement, pos + 1)) {
            if (pos > begin) out.push_back(v.substr(begin, pos - begin));
            begin = pos;
          }
          if (begin < v.size()) out.push_back(v.substr(begin));
          break;
        }
      }
    }
    pieces = std::move(out);
  }

  void encode_segment(std::string_view segment, bool at_start, std::vector<int32_t>& ids) const {
    if (segment.empty()) return;
    std::deque<std::string> arena;
    std::vector<std::string_view> pieces;
    if (p_.normalizers.empty()) {
      pieces.push_back(segment);
    } else {
      std::string& s = arena.emplace_back(segment);
      normalize(s);
      if (s.empty()) return;
      pieces.push_back(s);
    }
    for (const PreTokenizerStep& step : p_.pre_tokenizers) pre_tokenize(step, at_start, pieces, arena);
    for (std::string_view piece : pieces) {
      if (piece.empty()) continue;
      if (!p_.cut_at_space_pieces) {
        p_.bpe->encode_word(piece, ids);
        continue;
      }
      const std::string_view mark = kSpacePiece;
      size_t begin = 0;
      for (size_t pos = piece.find(mark, 1); pos != std::string_view::npos; pos = piece.find(mark, pos + 1)) {
        if (piece.substr(0, pos).ends_with(mark)) continue;  // inside a run
        p_.bpe->encode_word(piece.substr(begin, pos - begin), ids);
        begin = pos;
      }
      p_.bpe->encode_word(piece.substr(begin), ids);
    }
  }

  static void apply_decoder(const DecoderStep& d, std::vector<std::string>& tokens) {
    switch (d.kind) {
      case DecoderStep::Kind::kByteLevel:  // tokens are raw bytes already (converted at load)
        break;
      case DecoderStep::Kind::kReplace:
        for (std::string& t : tokens) replace_all(t, d.from, d.to);
        break;
      case DecoderStep::Kind::kByteFallback:
        decode_byte_fallback(tokens);
        break;
      case DecoderStep::Kind::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        break;
      }
      case DecoderStep::Kind::kStrip:
        for (std::string& t : tokens) {
          for (size_t i = 0; i < d.start && t.starts_with(d.content); ++i) t.erase(0, d.content.size());
          for (size_t i = 0; i < d.stop && t.ends_with(d.content); ++i) t.erase(t.size() - d.content.size());
        }
        break;
      case DecoderStep::Kind::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          replace_all(tokens[i], d.from, " ");
          if (i == 0 && d.prepend != PrependScheme::kNever && tokens[i].starts_with(' ')) tokens[i].erase(0, 1);
        }
        break;
    }
  }

    static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }

  // Runs of <0xNN> tokens become their bytes when those are valid UTF-8, else one U+FFFD
  // per byte (Hugging Face's ByteFallback decoder).
  static void decode_byte_fallback(std::vector<std::string>& tokens) {
    std::vector<std::string> out;
    std::string bytes;
    size_t count = 0;
    const auto flush = [&] {
      if (count == 0) return;
      if (replace_invalid_utf8(bytes)) {
        std::string r;
        for (size_t i = 0; i < count; ++i) r += "\xef\xbf\xbd";
        out.push_back(std::move(r));
      } else {
        out.push_back(bytes);
      }
      bytes.clear();
      count = 0;
    };
    for (std::string& t : tokens) {
      const int hi = t.size() == 6 && t.starts_with("<0x") && t.back() == '>' ? hex_digit(t[3]) : -1;
      const int lo = hi >= 0 ? hex_digit(t[4]) : -1;
      const bool is_byte = lo >= 0;
      const unsigned value = is_byte ? static_cast<unsigned>(hi * 16 + lo) : 0;
      if (is_byte) {
        bytes.push_back(static_cast<char>(value));
        ++count;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }

  Parts p_;
  std::array<std::vector<const AddedToken*>, 256> by_first_byte_;
  std::unordered_map<int32_t, const AddedToken*> added_by_id_;
  uint32_t vocab_size_ = 0;
};

// merges: ["a b", ...] or [["a", "b"], ...].
Result<std::vector<std::pair<std::string, std::string>>> read_merges(const json& merges, const std::string& path) {
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const json& m = merges[r];
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == s.size())
        return invalid_argument("tokenizer '{}': merge {} ('{}') is not two tokens separated by a space", path, r, s);
      out.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      out.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      return invalid_argument("tokenizer '{}': merge {} ({}) is neither \"a b\" nor [a, b]", path, r, m.dump());
    }
  }
  return out;
}

Status check_model_options(const json& model, const Parser& parser) {
  const std::string type = model.value("type", std::string("BPE"));
  if (type != "BPE") return parser.refuse("model type", type, "BPE");
  if (model.contains("dropout") && !model["dropout"].is_null()) return parser.refuse("BPE option", "dropout", "none");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty())
      return parser.refuse("BPE option", key, "empty or null");
  return Status();
}

std::optional<int32_t> token_id(const json& config, const char* key, const HfTokenizer::Parts& p, const TokenMap& vocab) {
  if (!config.contains(key)) return std::nullopt;
  const json& v = config[key];
  std::string content;
  if (v.is_string()) content = v.get<std::string>();
  else if (v.is_object() && v.contains("content") && v["content"].is_string()) content = v["content"].get<std::string>();
  else return std::nullopt;
  for (const AddedToken& a : p.added)
    if (a.content == content) return a.id;
  if (const auto it = vocab.find(content); it != vocab.end()) return it->second;
  return std::nullopt;
}

Result<std::unique_ptr<Tokenizer>> build(const json& j, const std::string& path) {
  const Parser parser(path);
  if (!j.is_object() || !j.contains("model")) return invalid_argument("tokenizer '{}' has no \"model\"", path);
  const json& model = j["model"];
  FP_RETURN_IF_ERROR(check_model_options(model, parser));
  HfTokenizer::Parts p;
  p.path = path;
  FP_ASSIGN_OR_RETURN(p.normalizers, parser.normalizer(j.value("normalizer", json())));
  FP_ASSIGN_OR_RETURN(p.pre_tokenizers, parser.pre_tokenizer(j.value("pre_tokenizer", json())));
  FP_ASSIGN_OR_RETURN(p.decoders, parser.decoder(j.value("decoder", json())));
  p.byte_level = std::any_of(p.pre_tokenizers.begin(), p.pre_tokenizers.end(),
                             [](const PreTokenizerStep& s) { return s.kind == PreTokenizerStep::Kind::kByteLevel; });
  for (const DecoderStep& d : p.decoders) {
    const bool byte_level_decoder = d.kind == DecoderStep::Kind::kByteLevel;
    if (byte_level_decoder != p.byte_level)
      return invalid_argument("tokenizer '{}': a {} decoder with {} pre-tokenizer is not implemented", path,
                              byte_level_decoder ? "ByteLevel" : "non-ByteLevel",
                              p.byte_level ? "a ByteLevel" : "no ByteLevel");
  }
  const std::map<char32_t, unsigned char> table = char_to_byte_table();
  const auto to_model = [&](const std::string& token) {
    if (!p.byte_level) return token;
    return byte_level_to_raw(token, table).value_or(token);
  };
  TokenMap vocab;
  for (const auto& [token, id_json] : model.at("vocab").items()) {
    const int64_t id = id_json.get<int64_t>();
    if (id < 0 || id > (int64_t{1} << 24))
      return invalid_argument("tokenizer '{}': token '{}' has id {} (expected 0..2^24)", path, token, id);
    const std::string t = to_model(token);
    if (p.id_to_token.size() <= static_cast<size_t>(id)) p.id_to_token.resize(id + 1);
    p.id_to_token[id] = t;
    vocab.emplace(t, static_cast<int32_t>(id));
  }
  p.cut_at_space_pieces = !p.byte_level && std::none_of(p.id_to_token.begin(), p.id_to_token.end(), [](const std::string& t) {
    const std::string_view mark = kSpacePiece;
    for (size_t pos = t.find(mark, 1); pos != std::string::npos; pos = t.find(mark, pos + 1))
      if (!std::string_view(t).substr(0, pos).ends_with(mark)) return true;
    return false;
  });
  FP_ASSIGN_OR_RETURN(auto merges, read_merges(model.value("merges", json::array()), path));
  for (auto& [a, b] : merges) {
    a = to_model(a);
    b = to_model(b);
  }
  for (const json& a : j.value("added_tokens", json::array())) {
    const std::string content = a.at("content").get<std::string>();
    for (const char* flag : {"lstrip", "rstrip", "single_word"})
      if (a.value(flag, false)) return parser.refuse(fmt::format("added token '{}' option", content), flag, "none");
    if (a.value("normalized", false) && !p.normalizers.empty())
      return parser.refuse(fmt::format("added token '{}' option", content), "normalized: true with a normalizer",
                           "normalized: false");
    p.added.push_back({content, a.at("id").get<int32_t>()});
  }
  BpeOptions o;
  o.byte_level = p.byte_level;
  o.byte_fallback = model.value("byte_fallback", false);
  o.fuse_unk = model.value("fuse_unk", false);
  o.ignore_merges = model.value("ignore_merges", false);
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    const auto it = vocab.find(model["unk_token"].get<std::string>());
    if (it == vocab.end())
      return invalid_argument("tokenizer '{}': unk_token '{}' is not in the vocabulary", path,
                              model["unk_token"].get<std::string>());
    o.unk_id = it->second;
  }
  const std::filesystem::path config_path = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  if (std::filesystem::is_regular_file(config_path)) {
    std::ifstream in(config_path);
    const json config = json::parse(in, nullptr, false);
    if (config.is_discarded()) return invalid_argument("'{}' is not valid JSON", config_path.string());
    p.bos = token_id(config, "bos_token", p, vocab);
    p.eos = token_id(config, "eos_token", p, vocab);
  }
  Result<BpeModel> bpe = BpeModel::build(std::move(vocab), merges, o);
  if (!bpe.ok()) return bpe.status().with_context(fmt::format("tokenizer '{}'", path));
  p.bpe.emplace(std::move(*bpe));
  return std::unique_ptr<Tokenizer>(std::make_unique<HfTokenizer>(std::move(p)));
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> load_hf_tokenizer(const std::string& path) {
  if (!std::filesystem::is_regular_file(path)) return not_found("tokenizer '{}' does not exist", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("cannot read tokenizer '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  const json j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded()) return invalid_argument("tokenizer '{}' is not valid JSON", path);
  try {
    return build(j, path);
  } catch (const json::exception& e) {  // a field of the wrong type or missing
    return invalid_argument("tokenizer '{}': {}", path, e.what());
  }
}

}  // namespace foldpar
