// Safetensors writing (header construction) and the atomic write protocol shared by every
// writer in io/ (atomic_file.h: temporary file in the target's directory -> fsync -> close
// -> rename -> fsync directory). The reader (and its validation) lives in safetensors.cc.
#include "io/safetensors.h"

#include "io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <nlohmann/json.hpp>
#include <set>

namespace foldpar {
namespace {

using ordered_json = nlohmann::ordered_json;

Status check_tensors(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::set<std::string_view> names;
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) return invalid_argument("tensor '{}' is undefined", name);
    if (name == "__metadata__") return invalid_argument("'__metadata__' is reserved and cannot name a tensor");
    if (!names.insert(name).second) return invalid_argument("tensor name '{}' is given twice", name);
  }
  return Status::ok_status();
}

// The JSON header, "__metadata__" first, tensors in the given order with contiguous data,
// padded with spaces so that the data section starts at a multiple of 8 bytes.
Result<std::string> build_header(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  ordered_json root = ordered_json::object();
  if (!metadata.empty()) root["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    ordered_json entry = ordered_json::object();
    entry["dtype"] = dtype_name(t.dtype());
    entry["shape"] = std::vector<int64_t>(t.shape().begin(), t.shape().end());
    entry["data_offsets"] = {offset, offset + t.nbytes()};
    offset += t.nbytes();
    root[name] = std::move(entry);
  }
  std::string text;
  try {
    text = root.dump();
  } catch (const nlohmann::json::exception& e) {  // type_error 316: a string is not UTF-8
    return invalid_argument("a tensor name or metadata string is not valid UTF-8: {}", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kSafetensorsMaxHeaderBytes) {
    return invalid_argument("the header would be {} bytes, above the {} readers accept", text.size(),
                            kSafetensorsMaxHeaderBytes);
  }
  return text;
}

Status write_contents(int fd, const std::string& tmp_path, const std::string& header,
                      const std::vector<std::pair<std::string, Tensor>>& tensors) {
  char length[8];
  uint64_t n = header.size();
  for (char& byte : length) {
    byte = static_cast<char>(n & 0xff);
    n >>= 8;
  }
  FP_RETURN_IF_ERROR(write_fully(fd, tmp_path, length, sizeof(length)));
  FP_RETURN_IF_ERROR(write_fully(fd, tmp_path, header.data(), header.size()));
  for (const auto& [name, t] : tensors) {
    if (t.nbytes() > 0) FP_RETURN_IF_ERROR(write_fully(fd, tmp_path, t.raw_data(), t.nbytes()));
  }
  return Status::ok_status();
}

}  // namespace

// Removes the temporary file unless the rename has consumed it.
namespace {
struct TempFileGuard {
  std::string path;
  bool renamed = false;
  ~TempFileGuard() {
    if (!path.empty() && !renamed) ::unlink(path.c_str());
  }
};

// A new file next to `path`, created exclusively with mode 0666 & ~umask (as a plain
// open would give the target), named "<path>.tmp-<pid>-<n>".
Result<ScopedFd> create_temp_file(const std::string& path, std::string* tmp_path) {
  const auto salt = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  for (int attempt = 0; attempt < 100; ++attempt) {
    *tmp_path = fmt::format("{}.tmp-{}-{:x}", path, ::getpid(), salt + static_cast<uint64_t>(attempt));
    ScopedFd fd(::open(tmp_path->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
    if (fd.valid()) return fd;
    if (errno != EEXIST) {
      const int err = errno;
      std::string tried = *tmp_path;
      tmp_path->clear();  // nothing was created, so nothing to remove
      return io_error("cannot create the temporary file '{}': {}", tried, errno_message(err));
    }
  }
  tmp_path->clear();
  return io_error("cannot create a temporary file next to '{}': 100 names were taken", path);
}

}  // namespace

Status fsync_directory(const std::string& dir) {
  ScopedFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return io_error("cannot open directory '{}' to sync it: {}", dir, errno_message(errno));
  // Some filesystems cannot sync a directory (EINVAL); the rename is as durable as they allow.
  if (::fsync(fd.get()) != 0 && errno != EINVAL) {
    return io_error("cannot fsync directory '{}': {}", dir, errno_message(errno));
  }
  return fd.close(dir);
}

Status write_file_atomically(const std::string& path,
                             const std::function<Status(int fd, const std::string& tmp_path)>& write_body) {
  TempFileGuard tmp;
  FP_ASSIGN_OR_RETURN(ScopedFd fd, create_temp_file(path, &tmp.path));
  FP_RETURN_IF_ERROR(write_body(fd.get(), tmp.path));
  if (::fsync(fd.get()) != 0) return io_error("cannot fsync '{}': {}", tmp.path, errno_message(errno));
  FP_RETURN_IF_ERROR(fd.close(tmp.path));
  if (::rename(tmp.path.c_str(), path.c_str()) != 0) {
    return io_error("cannot rename '{}' to '{}': {}", tmp.path, path, errno_message(errno));
  }
  tmp.renamed = true;
  const size_t slash = path.rfind('/');
  return fsync_directory(slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash)));
}


Status write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  const std::string context = fmt::format("writing '{}'", path);
  Status s = check_tensors(tensors);
  if (!s.ok()) return s.with_context(context);
  Result<std::string> header = build_header(tensors, metadata);
  if (!header.ok()) return header.status().with_context(context);
  return write_file_atomically(path, [&](int fd, const std::string& tmp_path) {
           return write_contents(fd, tmp_path, *header, tensors);
         }).with_context(context);
}

}  // namespace foldpar
