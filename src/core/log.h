// Minimal leveled logging to stderr, prefixed with the process identity (core/check.h).
// FOLDPAR_LOG=debug|info|warn|error selects the level (default info).
#pragma once

#include <fmt/format.h>

#include <string>
#include <utility>

namespace foldpar {

enum class LogLevel { kDebug = 0, kInfo, kWarn, kError };

LogLevel log_level();
void log_message(LogLevel level, const std::string& message);

template <typename... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() <= LogLevel::kDebug) log_message(LogLevel::kDebug, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() <= LogLevel::kInfo) log_message(LogLevel::kInfo, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() <= LogLevel::kWarn) log_message(LogLevel::kWarn, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_error(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::kError, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace foldpar
