// POSIX file helpers: descriptor ownership and retrying read/write loops.
#include "io/posix_file.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace foldpar {

ScopedFd& ScopedFd::operator=(ScopedFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

ScopedFd::~ScopedFd() {
  if (fd_ >= 0) ::close(fd_);
}

int ScopedFd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

Status ScopedFd::close(const std::string& path) {
  const int fd = release();
  // Linux frees the descriptor even when close() fails, so it is never retried.
  if (fd >= 0 && ::close(fd) != 0) return io_error("cannot close '{}': {}", path, errno_message(errno));
  return Status::ok_status();
}

std::string errno_message(int err) { return fmt::format("{} (errno {})", std::strerror(err), err); }

Status read_fully_at(int fd, const std::string& path, uint64_t offset, void* dst, size_t bytes) {
  char* p = static_cast<char*>(dst);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd, p + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return io_error("cannot read {} bytes at offset {} of '{}': {}", bytes, offset, path, errno_message(errno));
    }
    if (n == 0) {
      return corrupt("'{}' ends after {} of the {} bytes expected at offset {} (was it truncated?)", path, done,
                     bytes, offset);
    }
    done += static_cast<size_t>(n);
  }
  return Status::ok_status();
}

Status write_fully(int fd, const std::string& path, const void* src, size_t bytes) {
  const char* p = static_cast<const char*>(src);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd, p + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return io_error("cannot write {} bytes to '{}' after {} written: {}", bytes - done, path, done,
                      errno_message(errno));
    }
    if (n == 0) return io_error("cannot write to '{}': the OS accepted no bytes after {} written", path, done);
    done += static_cast<size_t>(n);
  }
  return Status::ok_status();
}

}  // namespace foldpar
