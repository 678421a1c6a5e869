// Replays the fuzzing corpus in the normal build (no libFuzzer): every file under
// tests/data/fuzz_corpus/<reader>/ (and tests/data/safetensors_corpus/) goes through the
// entry point its libFuzzer target drives (fuzz/fuzz_readers.h), as do hostile inputs too
// large to check in (nesting 200k levels deep, multi-megabyte strings). Each input must end
// in a result or a one-line error (fuzz_readers.h FP_CHECKs that), within kSecondsPerInput,
// with no single heap allocation above kAllocationSlack + kAllocationPerByte * its size and
// no more tracked tensor memory than kTensorPerByte * its size. Files named valid_* must be
// accepted, so a reader that rejects everything fails too. The findings of the fuzzers are
// pinned below with their messages.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <new>
#include <sstream>

#include "../../fuzz/fuzz_readers.h"

namespace fs = std::filesystem;

// ---- the largest single heap allocation, counted while an input is being read ----------
namespace {
std::atomic<bool> g_counting{false};
std::atomic<size_t> g_largest{0};

void* counted_malloc(size_t bytes) {
  if (g_counting.load(std::memory_order_relaxed)) {
    size_t seen = g_largest.load(std::memory_order_relaxed);
    while (bytes > seen && !g_largest.compare_exchange_weak(seen, bytes)) {
    }
  }
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(size_t bytes) { return counted_malloc(bytes); }
void* operator new[](size_t bytes) { return counted_malloc(bytes); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace foldpar {
namespace {

// Generous: the slowest input takes well under 1 s under AddressSanitizer on a loaded
// 2-core machine; a hang is caught by the alarm at kHangSeconds.
constexpr double kSecondsPerInput = 10;
constexpr unsigned kHangSeconds = 60;
// A reader may copy its input and build a DOM of it (nlohmann: 16 bytes per value, vectors
// doubling), never allocate what a size field claims.
constexpr size_t kAllocationSlack = size_t{1} << 20;
constexpr size_t kAllocationPerByte = 32;
// Tensors read from a file: the stored copy plus a conversion (BF16 -> F32 doubles it).
constexpr int64_t kTensorPerByte = 3;

// The input being read, for the signal handler's last words.
const char* volatile g_current_input = "(none)";

void say_which_input(int sig) {
  const char* what = sig == SIGALRM ? "fuzz_corpus_test: no result within the time limit on "
                                    : "fuzz_corpus_test: died reading ";
  [[maybe_unused]] ssize_t n = ::write(2, what, std::strlen(what));
  n = ::write(2, g_current_input, std::strlen(g_current_input));
  n = ::write(2, "\n", 1);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Names the input on a hang, an abort (FP_CHECK) or a crash; leaves a handler a sanitizer
// installed in place.
void install_last_words() {
  for (int sig : {SIGALRM, SIGABRT, SIGSEGV, SIGBUS, SIGFPE}) {
    struct sigaction old {};
    sigaction(sig, nullptr, &old);
    if (old.sa_handler == SIG_DFL) ::signal(sig, say_which_input);
  }
}

fs::path data_dir() { return fs::path(FOLDPAR_SOURCE_DIR) / "tests/data"; }

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

using Reader = std::function<bool(std::string_view)>;

// Runs one input under the time, allocation and tracked-memory bounds; returns whether the
// reader accepted it.
bool replay(const Reader& reader, const std::string& name, std::string_view bytes) {
  g_current_input = name.c_str();
  MemoryTracker::process().reset_peaks();
  const int64_t tensors_before = MemoryTracker::process().stats().current_total;
  g_largest = 0;
  ::alarm(kHangSeconds);
  const auto start = std::chrono::steady_clock::now();
  bool accepted = false;
  g_counting = true;
  try {
    accepted = reader(bytes);
  } catch (const std::exception& e) {
    ADD_FAILURE() << name << ": an exception escaped the reader: " << e.what();
  } catch (...) {
    ADD_FAILURE() << name << ": an exception escaped the reader";
  }
  g_counting = false;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::alarm(0);
  g_current_input = "(none)";
  EXPECT_LT(seconds, kSecondsPerInput) << name;
  EXPECT_LE(g_largest.load(), kAllocationSlack + kAllocationPerByte * bytes.size())
      << name << ": one allocation of " << g_largest.load() << " bytes for an input of " << bytes.size();
  const int64_t tensors = MemoryTracker::process().stats().peak_total - tensors_before;
  EXPECT_LE(tensors, kTensorPerByte * static_cast<int64_t>(bytes.size()) + 4096)
      << name << ": " << tensors << " bytes of tensors for an input of " << bytes.size();
  return accepted;
}

// Every file of `dirs`; returns how many were replayed.
size_t replay_dirs(const Reader& reader, const std::vector<fs::path>& dirs) {
  install_last_words();
  size_t count = 0;
  for (const fs::path& dir : dirs) {
    EXPECT_TRUE(fs::is_directory(dir)) << dir;
    if (!fs::is_directory(dir)) continue;
    for (const auto& entry : fs::directory_iterator(dir)) {
      const std::string name = entry.path().string();
      const bool accepted = replay(reader, name, read_bytes(entry.path()));
      if (entry.path().filename().string().starts_with("valid")) {
        EXPECT_TRUE(accepted) << name << " was rejected";
      }
      ++count;
    }
  }
  return count;
}

fs::path corpus(const char* reader) { return data_dir() / "fuzz_corpus" / reader; }

TEST(FuzzCorpus, SafetensorsInputsEndInATensorOrAClearError) {
  EXPECT_GT(replay_dirs(fuzz::run_safetensors, {corpus("safetensors"), data_dir() / "safetensors_corpus"}), 40u);
}

TEST(FuzzCorpus, CheckpointManifestInputsEndInAManifestOrAClearError) {
  EXPECT_GT(replay_dirs(fuzz::run_checkpoint_manifest, {corpus("checkpoint_manifest")}), 10u);
}

TEST(FuzzCorpus, LlamaConfigInputsEndInAConfigOrAClearError) {
  EXPECT_GT(replay_dirs(fuzz::run_llama_config, {corpus("llama_config")}), 10u);
}

TEST(FuzzCorpus, TokenFileInputsEndInTokensOrAClearError) {
  EXPECT_GT(replay_dirs(fuzz::run_token_file, {corpus("token_file")}), 10u);
}

TEST(FuzzCorpus, NpyInputsEndInTokensOrAClearError) {
  EXPECT_GT(replay_dirs(fuzz::run_npy, {corpus("npy")}), 10u);
}

// Checked-in inputs stay small: the corpus is for replaying, not for storing data.
TEST(FuzzCorpus, CorpusFilesAreSmall) {
  for (const char* reader : {"safetensors", "checkpoint_manifest", "llama_config", "token_file", "npy"}) {
    for (const auto& entry : fs::directory_iterator(corpus(reader))) {
      EXPECT_LE(fs::file_size(entry.path()), 16u * 1024) << entry.path();
    }
  }
}

// ---- inputs too large to check in ---------------------------------------------------------

std::string nested(const std::string& before, int depth, const std::string& after) {
  return before + std::string(static_cast<size_t>(depth), '[') + std::string(static_cast<size_t>(depth), ']') + after;
}

std::string manifest_with_config(const std::string& config) {
  return R"({"format":"foldpar-checkpoint","version":1,"step":4,"next_batch":4,"seed":3,"layout":"tsp=2","config":)" +
         config + R"(,"files":["rank-00000.safetensors"]})";
}

// Found by reading after the fuzzers: nlohmann parses any depth, but dump() recurses, and
// the config reader dumped an offending value into its message; 200k levels overflowed the
// stack (a 400 KB file). Both JSON readers now refuse more than 16 levels.
TEST(FuzzCorpus, DeepNestingIsAnErrorNotAStackOverflow) {
  install_last_words();
  const std::string config = nested(R"({"hidden_size":)", 200000, "}");
  EXPECT_FALSE(replay(fuzz::run_llama_config, "config nested 200k deep", config));
  Result<LlamaConfig> c = LlamaConfig::from_json(config);
  EXPECT_NE(c.status().message().find("nests deeper than 16 levels"), std::string::npos) << c.status().to_string();

  const std::string manifest = manifest_with_config(nested(R"({"hidden_size":)", 200000, "}"));
  EXPECT_FALSE(replay(fuzz::run_checkpoint_manifest, "manifest nested 200k deep", manifest));
  Result<CheckpointManifest> m = parse_checkpoint_manifest(manifest);
  EXPECT_NE(m.status().message().find("nests deeper than 16 levels"), std::string::npos) << m.status().to_string();

  // The safetensors header parser has capped its depth from the start.
  std::string header = nested(R"({"a":)", 200000, "}");
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[static_cast<size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  EXPECT_FALSE(replay(fuzz::run_safetensors, "safetensors header nested 200k deep", file + header));
}

// A multi-megabyte value is quoted into the message in at most 100 bytes.
TEST(FuzzCorpus, HugeValuesGiveShortMessages) {
  install_last_words();
  const std::string big(4 << 20, 'x');
  const std::string config = R"({"hidden_size":")" + big + R"("})";
  EXPECT_FALSE(replay(fuzz::run_llama_config, "config with a 4 MiB string", config));
  EXPECT_FALSE(replay(fuzz::run_checkpoint_manifest, "manifest with a 4 MiB layout",
                      R"({"format":"foldpar-checkpoint","step":1,"next_batch":1,"layout":[")" + big + R"("]})"));
  const std::string numbers = "[" + std::string(1 << 20, '1') + "]";  // one huge integer literal
  EXPECT_FALSE(replay(fuzz::run_llama_config, "config with a 1 MiB number", R"({"vocab_size":)" + numbers + "}"));
}

// ---- the fuzzers' findings, pinned with their messages --------------------------------------

std::string manifest_error(const std::string& text) {
  Result<CheckpointManifest> m = parse_checkpoint_manifest(text);
  EXPECT_FALSE(m.ok()) << text;
  return m.ok() ? std::string() : m.status().message();
}

std::string valid_manifest() { return read_bytes(corpus("checkpoint_manifest") / "valid.json"); }

std::string replace(std::string s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return at == std::string::npos ? s : s.replace(at, from.size(), to);
}

// checkpoint_manifest_fuzzer, first seconds: "format": 12 made nlohmann's value() throw
// type_error 302 out of read_checkpoint_state (std::terminate). Likewise "seed" and "layout".
TEST(FuzzCorpus, ManifestFieldsOfTheWrongTypeAreErrorsNamingTheField) {
  const std::string valid = valid_manifest();
  ASSERT_TRUE(parse_checkpoint_manifest(valid).ok()) << parse_checkpoint_manifest(valid).status().to_string();
  EXPECT_EQ(manifest_error(replace(valid, R"("foldpar-checkpoint")", "12")),
            R"("format" must be "foldpar-checkpoint", not 12)");
  EXPECT_EQ(manifest_error(replace(valid, R"("seed": 3)", R"("seed": "three")")),
            R"("seed" must be a non-negative integer, not "three")");
  EXPECT_EQ(manifest_error(replace(valid, R"("layout": "tsp=2")", R"("layout": 2)")),
            R"("layout" must be a string, not 2)");
  EXPECT_EQ(manifest_error(replace(valid, R"("step": 12)", R"("step": -4)")),
            R"("step" must be an integer in [0, 2^63), not -4)");
  EXPECT_EQ(manifest_error(replace(valid, R"("version": 1)", R"("version": 2)")),
            "manifest version 2 (this build reads 1)");
}

// A manifest names files inside its directory; "../x" or "/etc/passwd" would read elsewhere.
TEST(FuzzCorpus, ManifestFileNamesMustStayInsideTheCheckpoint) {
  const std::string valid = valid_manifest();
  for (const char* bad : {"../../etc/passwd", "/etc/passwd", "..", ".", ""}) {
    const std::string text = replace(valid, R"("rank-00000.safetensors")", fmt::format("\"{}\"", bad));
    EXPECT_NE(manifest_error(text).find("plain file names in the checkpoint directory"), std::string::npos) << bad;
  }
}

// Found by reading alongside llama_config_fuzzer (UBSan: signed overflow at
// llama_config.cc): head_dim * num_attention_heads overflowed int64. head_dim is a
// supported field now, so the value is refused as out of range.
TEST(FuzzCorpus, AHeadDimThatOverflowsIsRefusedNotUndefined) {
  Result<LlamaConfig> c = LlamaConfig::from_json(
      R"({"hidden_size":64,"intermediate_size":192,"num_attention_heads":4,"num_hidden_layers":2,)"
      R"("vocab_size":256,"head_dim":4611686018427387904})");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("head_dim (4611686018427387904)"), std::string::npos) << c.status().message();
}

// safetensors_fuzzer, within two minutes: a tensor name holding a newline (escaped in the
// JSON) was quoted raw, so the error spanned several lines; an ESC could drive the terminal.
// Control characters in quoted names are escaped now.
TEST(FuzzCorpus, ControlCharactersInNamesAreEscapedInMessages) {
  for (const char* file : {"newline_in_name_found_by_fuzzer.safetensors", "escape_sequence_in_name.safetensors",
                           "newline_in_unknown_key.safetensors"}) {
    const std::string bytes = read_bytes(corpus("safetensors") / file);
    Result<SafetensorsHeader> h = parse_safetensors_header(bytes, bytes.size());
    ASSERT_FALSE(h.ok()) << file;
    const std::string& message = h.status().message();
    for (char c : message) EXPECT_FALSE(static_cast<unsigned char>(c) < 0x20) << file << ": " << message;
    EXPECT_TRUE(message.find("\\x0a") != std::string::npos || message.find("\\x1b") != std::string::npos)
        << file << ": " << message;
  }
}

}  // namespace
}  // namespace foldpar
