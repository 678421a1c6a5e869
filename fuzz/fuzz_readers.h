// The readers of untrusted files, driven with arbitrary bytes: one function per reader, shared
// by the libFuzzer targets (fuzz/*_fuzzer.cc) and by tests/unit/fuzz_corpus_test.cc, which
// replays the checked-in corpus (tests/data/fuzz_corpus/<target>/) in the normal build.
// Header-only so the unit test needs neither libFuzzer nor clang.
//
// What must hold for ANY input, checked here with FP_CHECK (a failure is a finding):
//  - the reader returns: no crash, no uncaught exception, no sanitizer report;
//  - a rejection is a Status whose message is one line of at most kMaxMessageBytes;
//  - an accepted input satisfies the reader's invariants (listed at each function).
// Time and memory bounds are the caller's: libFuzzer's -timeout and -malloc_limit_mb, the
// unit test's alarm and allocation counter.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <string_view>

#include "checkpoint/checkpoint.h"
#include "core/check.h"
#include "core/status.h"
#include "io/safetensors.h"
#include "data/token_stream.h"
#include "io/token_file.h"
#include "model/llama_config.h"

namespace foldpar::fuzz {

// The longest error message a reader may give (the readers quote at most ~200 bytes of
// the offending input, twice).
constexpr size_t kMaxMessageBytes = 1024;

inline void check_rejection(const Status& s, const char* reader) {
  FP_CHECK(!s.ok());
  FP_CHECK(!s.message().empty(), "{}: an empty error message", reader);
  FP_CHECK(s.message().size() <= kMaxMessageBytes, "{}: an error message of {} bytes: {}...", reader,
           s.message().size(), s.message().substr(0, 300));
  FP_CHECK(s.message().find('\n') == std::string::npos, "{}: an error message of several lines: {}", reader,
           s.message().substr(0, 300));
}

// Safetensors, both ways in: the pure header parser on the bytes, then the file reader on
// the same bytes in a memory file, reading every tensor as stored and converted.
// Accepted: both paths agree; entries are sorted and unique, each holds
// numel * dtype_size bytes, and sorted by offset they tile the data section exactly; every
// tensor reads back with that many bytes.
inline bool run_safetensors(std::string_view bytes) {
  Result<SafetensorsHeader> parsed = parse_safetensors_header(bytes, bytes.size());
  if (!parsed.ok()) check_rejection(parsed.status(), "parse_safetensors_header");
  if (parsed.ok()) {
    const SafetensorsHeader& h = *parsed;
    FP_CHECK(h.data_start == kSafetensorsLengthBytes + h.header_bytes && h.data_start <= bytes.size());
    FP_CHECK(h.data_bytes == bytes.size() - h.data_start);
    uint64_t covered = 0;
    for (size_t i = 0; i < h.entries.size(); ++i) {
      const SafetensorsEntry& e = h.entries[i];
      FP_CHECK(i == 0 || h.entries[i - 1].name < e.name, "entries not sorted and unique at '{}'", e.name);
      FP_CHECK(e.data_begin <= e.data_end && e.data_end <= h.data_bytes);
      FP_CHECK(e.nbytes() == static_cast<uint64_t>(e.shape.numel()) * dtype_size(e.dtype));
      covered += e.nbytes();
    }
    FP_CHECK(covered == h.data_bytes, "entries cover {} of {} data bytes", covered, h.data_bytes);
  }

  const int fd = memfd_create("fuzz-safetensors", MFD_CLOEXEC);
  FP_CHECK(fd >= 0, "memfd_create");
  FP_CHECK(bytes.empty() || ::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
  Result<SafetensorsFile> file = SafetensorsFile::open(fmt::format("/proc/self/fd/{}", fd));
  if (!file.ok()) check_rejection(file.status(), "SafetensorsFile::open");
  FP_CHECK(file.ok() == parsed.ok(), "the file reader says '{}', the header parser '{}'", file.status().to_string(),
           parsed.status().to_string());
  if (file.ok()) {
    for (const SafetensorsEntry& e : file->entries()) {
      {
        Result<Tensor> t = file->read(e.name, MemCategory::kWorkspace);
        FP_CHECK(t.ok(), "{}", t.status().to_string());
        FP_CHECK(static_cast<uint64_t>(t->numel()) * dtype_size(t->dtype()) == e.nbytes());
      }  // released: the conversion below holds the stored copy and the converted one
      const bool is_float = e.dtype == DType::kF32 || e.dtype == DType::kF64 || e.dtype == DType::kBF16;
      Result<Tensor> converted = file->read_as(e.name, is_float ? DType::kF32 : DType::kI32, MemCategory::kWorkspace);
      if (!converted.ok()) check_rejection(converted.status(), "SafetensorsFile::read_as");
    }
  }
  ::close(fd);
  return parsed.ok();
}

// manifest.json of a checkpoint. Accepted: a valid model config that survives a round trip.
inline bool run_checkpoint_manifest(std::string_view bytes) {
  Result<CheckpointManifest> m = parse_checkpoint_manifest(bytes);
  if (!m.ok()) {
    check_rejection(m.status(), "parse_checkpoint_manifest");
    return false;
  }
  FP_CHECK(m->state.config.validate().ok());
  return true;
}

// config.json (LlamaConfig::from_json). Accepted: validate() passes, and to_json() reads
// back as the same config.
inline bool run_llama_config(std::string_view bytes) {
  Result<LlamaConfig> c = LlamaConfig::from_json(std::string(bytes));
  if (!c.ok()) {
    check_rejection(c.status(), "LlamaConfig::from_json");
    return false;
  }
  FP_CHECK(c->validate().ok());
  Result<LlamaConfig> again = LlamaConfig::from_json(c->to_json());
  FP_CHECK(again.ok(), "{}", again.status().to_string());
  FP_CHECK(again->to_json() == c->to_json());
  return true;
}

// Token files. Accepted: the ids fill the file exactly and each is below the vocabulary.
inline bool run_token_file(std::string_view bytes) {
  Result<TokenFile> t = parse_token_file(bytes);
  if (!t.ok()) {
    check_rejection(t.status(), "parse_token_file");
    return false;
  }
  const uint64_t payload = bytes.size() - kTokenFileHeaderBytes;
  const uint64_t width = static_cast<unsigned char>(bytes[16]);  // bytes 16-19, u32 LE, validated as 1, 2 or 4
  FP_CHECK(payload == t->ids.size() * width, "{} ids of {} bytes in {} bytes", t->ids.size(), width, payload);
  for (int32_t id : t->ids) FP_CHECK(id >= 0 && static_cast<uint32_t>(id) < t->vocab_size, "id {}", id);
  return true;
}

// NumPy .npy token arrays (prepare-data --input-format npy), checked against a vocabulary of
// 65536. Accepted: the header's element count times its width fills the rest of the file
// exactly, and every id is in [0, 65536).
inline bool run_npy(std::string_view bytes) {
  constexpr uint32_t kVocab = 65536;
  Result<std::vector<int32_t>> ids = decode_token_stream(bytes, TokenInputFormat::kNpy, kVocab, "fuzz.npy");
  if (!ids.ok()) {
    check_rejection(ids.status(), "decode_token_stream");
    return false;
  }
  Result<NpyHeader> h = parse_npy_header(bytes, "fuzz.npy");
  FP_CHECK(h.ok(), "an accepted array whose header is refused: {}", h.status().to_string());
  FP_CHECK(h->data_offset + ids->size() * h->width == bytes.size(), "{} ids of {} bytes from {} in {} bytes",
           ids->size(), h->width, h->data_offset, bytes.size());
  for (int32_t id : *ids) FP_CHECK(id >= 0 && static_cast<uint32_t>(id) < kVocab, "id {}", id);
  return true;
}

}  // namespace foldpar::fuzz
