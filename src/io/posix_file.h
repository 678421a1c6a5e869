// Thin POSIX file helpers for the io layer: an owning file descriptor and read/write loops
// that retry short transfers and EINTR. Errors come back as Statuses naming the path and
// strerror; nothing here aborts. Internal to io/ (the public API is in safetensors.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/status.h"

namespace foldpar {

// Owns a file descriptor; closes it on destruction. Move-only.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(ScopedFd&& o) noexcept : fd_(o.release()) {}
  ScopedFd& operator=(ScopedFd&& o) noexcept;
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  // Closes now and reports the error close() gives (NFS reports write errors only here).
  Status close(const std::string& path);

 private:
  int fd_ = -1;
};

// "No such file or directory (errno 2)".
std::string errno_message(int err);

// Reads exactly `bytes` bytes at `offset` into `dst`. kCorrupt if the file ends first
// (it shrank, or lied about its size), kIoError if the OS refuses.
Status read_fully_at(int fd, const std::string& path, uint64_t offset, void* dst, size_t bytes);

// Writes all `bytes` bytes of `src` at the current position; kIoError on any failure
// (ENOSPC, EFBIG, EIO...).
Status write_fully(int fd, const std::string& path, const void* src, size_t bytes);

}  // namespace foldpar
