// Safetensors files (the Hugging Face format): a strict reader and an atomic writer.
// Layout: u64 little-endian N, N bytes of UTF-8 JSON (padded with trailing spaces), then the
// data section. Every header is validated in full before any tensor is read: a file that is
// malformed or lies about itself gives a kCorrupt Status naming the file, tensor and numbers;
// nothing here crashes, reads out of bounds or allocates more than the file can justify.
// Not here: mmap, lazy slicing of a tensor, sharded (index.json) checkpoints.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "io/posix_file.h"
#include "tensor/tensor.h"

namespace foldpar {

// Largest header accepted, as in the reference Rust implementation: a longer length prefix
// is rejected before anything is allocated.
constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;
// The u64 header length that opens every file.
constexpr uint64_t kSafetensorsLengthBytes = 8;

// One tensor of a file. Offsets are relative to the start of the data section.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t data_begin = 0;
  uint64_t data_end = 0;
  uint64_t nbytes() const { return data_end - data_begin; }
};

// A validated header. Invariants: entry names are unique and differ from "__metadata__";
// each entry's byte size is shape.numel() * dtype_size(dtype); the entries sorted by
// offset tile [0, data_bytes) exactly, with no gap and no overlap.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;        // sorted by name
  std::map<std::string, std::string> metadata;  // the "__metadata__" object, if any
  uint64_t header_bytes = 0;                    // N, the JSON length including padding
  uint64_t data_start = 0;                      // 8 + N: file offset of the data section
  uint64_t data_bytes = 0;                      // file size - data_start

  // nullptr when no entry has that name.
  const SafetensorsEntry* find(std::string_view name) const;
};

// N, the header length of a file of `file_size` bytes that begins with `first_bytes` (8 or
// more), checked against kSafetensorsMaxHeaderBytes and the file size, so that a reader can
// size its buffer before reading. kCorrupt naming the numbers otherwise.
Result<uint64_t> parse_safetensors_header_length(std::string_view first_bytes, uint64_t file_size);

// Validates the header of a file of `file_size` bytes whose first bytes are `file_prefix`
// (the whole file, or at least its first 8 + N bytes). Pure: no I/O, so a fuzzer can drive
// it. kCorrupt for a malformed header, kUnimplemented for a valid safetensors dtype or rank
// foldpar cannot hold (F16, U8, ...; rank above Shape::kMaxRank), kInvalidArgument when the
// prefix is shorter than the header it announces.
Result<SafetensorsHeader> parse_safetensors_header(std::string_view file_prefix, uint64_t file_size);

// An open, validated safetensors file. Keeps the file descriptor open, so reads see the file
// that was validated even if the path is later replaced. Move-only. The const methods may
// run on several threads at once (reads use pread, which keeps no file position).
class SafetensorsFile {
 public:
  // Reads and validates the header against the file's size; errors name `path`.
  static Result<SafetensorsFile> open(const std::string& path);

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  const std::vector<SafetensorsEntry>& entries() const { return header_.entries; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  bool contains(std::string_view name) const { return header_.find(name) != nullptr; }

  // The tensor `name` in its stored dtype and shape, in new storage counted under
  // `category` (host memory by default: the file is read into it on the host). kNotFound for an unknown name; kCorrupt if the file shrank since open().
  Result<Tensor> read(std::string_view name, MemCategory category,
                      MemoryTracker& tracker = MemoryTracker::host_staging()) const;
  // As read(), converted to `want`: F32/F64/BF16 among themselves (rounding to nearest
  // even) and I32/I64 among themselves. kInvalidArgument for a conversion across the two
  // families or an integer that does not fit in `want` (the message names its index).
  // The stored tensor is read into kWorkspace first, so the peak holds both copies.
  Result<Tensor> read_as(std::string_view name, DType want, MemCategory category,
                         MemoryTracker& tracker = MemoryTracker::host_staging()) const;

 private:
  SafetensorsFile(std::string path, ScopedFd fd, SafetensorsHeader header)
      : path_(std::move(path)), fd_(std::move(fd)), header_(std::move(header)) {}

  std::string path_;
  ScopedFd fd_;
  SafetensorsHeader header_;
};

// Writes `tensors` (in this order, data contiguous) and `metadata` to `path` atomically: the
// bytes go to a temporary file in the same directory, which is fsynced and then renamed over
// `path`, so a crash or a full disk never leaves a half-written file where a good one was.
// The header is padded with spaces to a multiple of 8 bytes. kInvalidArgument for an
// undefined tensor, a duplicate name, the name "__metadata__" or text that is not UTF-8;
// kIoError naming the path and the OS error otherwise; the temporary file is removed on
// every failure.
Status write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace foldpar
