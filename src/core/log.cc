// Logging implementation: one fprintf per line so lines from concurrent ranks do not interleave.
#include "core/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/check.h"

namespace foldpar {

LogLevel log_level() {
  static const LogLevel level = [] {
    const char* env = std::getenv("FOLDPAR_LOG");
    if (env == nullptr) return LogLevel::kInfo;
    if (std::strcmp(env, "debug") == 0) return LogLevel::kDebug;
    if (std::strcmp(env, "warn") == 0) return LogLevel::kWarn;
    if (std::strcmp(env, "error") == 0) return LogLevel::kError;
    return LogLevel::kInfo;
  }();
  return level;
}

void log_message(LogLevel level, const std::string& message) {
  static const char* const kNames[] = {"debug", "info", "warn", "error"};
  const std::string& who = process_identity();
  std::fprintf(stderr, "[foldpar %s%s%s] %s\n", kNames[static_cast<int>(level)], who.empty() ? "" : " ",
               who.c_str(), message.c_str());
}

}  // namespace foldpar
