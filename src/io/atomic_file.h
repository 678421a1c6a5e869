// Writing a file so that readers see either the old contents or the complete new ones:
// the bytes go to a temporary file next to the target, which is fsynced, closed and renamed
// over it, and the directory is fsynced so the rename survives a crash. Every failure
// before the rename removes the temporary file and leaves the target as it was.
#pragma once

#include <functional>
#include <string>

#include "core/status.h"

namespace foldpar {

// `write_body(fd, tmp_path)` writes the contents (with write_fully, io/posix_file.h).
Status write_file_atomically(const std::string& path,
                             const std::function<Status(int fd, const std::string& tmp_path)>& write_body);

// fsync of a directory, so that entries created or renamed in it are durable.
Status fsync_directory(const std::string& dir);

}  // namespace foldpar
