// Token file reading and writing.
#include "io/token_file.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cstring>

#include "io/atomic_file.h"
#include "io/posix_file.h"

namespace foldpar {
namespace {

constexpr char kMagic[8] = {'F', 'P', 'T', 'O', 'K', 'E', 'N', 'S'};
constexpr uint32_t kVersion = 1;

uint64_t load_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

void store_le(char* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i, v >>= 8) p[i] = static_cast<char>(v & 0xff);
}

}  // namespace

uint32_t token_width_for(uint32_t vocab_size) { return vocab_size <= 256 ? 1 : (vocab_size <= 65536 ? 2 : 4); }

Result<TokenFile> parse_token_file(std::string_view b) {
  if (b.size() < kTokenFileHeaderBytes)
    return corrupt("token file of {} bytes is shorter than its {}-byte header", b.size(), kTokenFileHeaderBytes);
  if (std::memcmp(b.data(), kMagic, sizeof kMagic) != 0) return corrupt("not a token file (bad magic)");
  const auto version = static_cast<uint32_t>(load_le(b.data() + 8, 4));
  if (version != kVersion) return corrupt("token file version {} (this build reads {})", version, kVersion);
  TokenFile f;
  f.vocab_size = static_cast<uint32_t>(load_le(b.data() + 12, 4));
  const auto width = static_cast<uint32_t>(load_le(b.data() + 16, 4));
  const uint64_t count = load_le(b.data() + 24, 8);
  if (f.vocab_size == 0 || f.vocab_size > (1u << 31))
    return corrupt("token file vocabulary size {} outside [1, 2^31]", f.vocab_size);
  if (width != 1 && width != 2 && width != 4) return corrupt("token file id width {} is not 1, 2 or 4", width);
  const uint64_t payload = b.size() - kTokenFileHeaderBytes;
  if (count > payload / width || count * width != payload)
    return corrupt("token file announces {} ids of {} bytes but holds {} bytes after the header", count, width,
                   payload);
  f.ids.resize(count);
  const char* p = b.data() + kTokenFileHeaderBytes;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t id = load_le(p + i * width, static_cast<int>(width));
    if (id >= f.vocab_size) return corrupt("token {} at index {} is outside the vocabulary [0, {})", id, i, f.vocab_size);
    f.ids[i] = static_cast<int32_t>(id);
  }
  return f;
}

Result<TokenFile> read_token_file(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return not_found("cannot open token file '{}': {}", path, errno_message(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return io_error("cannot stat '{}': {}", path, errno_message(errno));
  if (!S_ISREG(st.st_mode)) return invalid_argument("'{}' is not a regular file", path);
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  FP_RETURN_IF_ERROR(read_fully_at(fd.get(), path, 0, bytes.data(), bytes.size()));
  Result<TokenFile> f = parse_token_file(bytes);
  if (!f.ok()) return f.status().with_context(path);
  return f;
}

Status write_token_file(const std::string& path, uint32_t vocab_size, const std::vector<int32_t>& ids) {
  if (vocab_size == 0) return invalid_argument("token file vocabulary size must be positive");
  const uint32_t width = token_width_for(vocab_size);
  std::string bytes(kTokenFileHeaderBytes + ids.size() * width, '\0');
  std::memcpy(bytes.data(), kMagic, sizeof kMagic);
  store_le(bytes.data() + 8, kVersion, 4);
  store_le(bytes.data() + 12, vocab_size, 4);
  store_le(bytes.data() + 16, width, 4);
  store_le(bytes.data() + 24, ids.size(), 8);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || static_cast<uint32_t>(ids[i]) >= vocab_size)
      return invalid_argument("token {} at index {} is outside the vocabulary [0, {})", ids[i], i, vocab_size);
    store_le(bytes.data() + kTokenFileHeaderBytes + i * width, static_cast<uint32_t>(ids[i]), static_cast<int>(width));
  }
  return write_file_atomically(path, [&](int fd, const std::string& tmp) {
    return write_fully(fd, tmp, bytes.data(), bytes.size());
  });
}

}  // namespace foldpar
