// Always-on invariant checks. A failed FP_CHECK is a bug in foldpar (or a library failure
// that cannot be recovered from): it prints the condition, file:line, the process identity
// (rank and host, once the comm layer has set it) and then runs the process's fatal
// handler, which by default aborts and under MPI aborts the whole job so no peer hangs.
// Never use assert(): it vanishes in release builds.
#pragma once

#include <fmt/format.h>

#include <string>
#include <utility>

namespace foldpar {

// What a fatal error runs after printing. The comm layer installs MPI_Abort here; the
// default calls std::abort(). Process-wide by nature, like std::set_terminate.
using FatalHandler = void (*)(int exit_code);
void set_fatal_handler(FatalHandler handler);

// "rank 3 on node07": printed with every fatal message and log line. Set by the comm layer.
void set_process_identity(const std::string& identity);
const std::string& process_identity();

[[noreturn]] void fatal_error(const char* file, int line, const std::string& message);

namespace detail {
template <typename... Args>
[[noreturn]] void check_failed(const char* file, int line, const char* cond,
                               fmt::format_string<Args...> f, Args&&... args) {
  fatal_error(file, line,
              fmt::format("check failed: {}: {}", cond, fmt::format(f, std::forward<Args>(args)...)));
}
[[noreturn]] inline void check_failed(const char* file, int line, const char* cond) {
  fatal_error(file, line, fmt::format("check failed: {}", cond));
}
}  // namespace detail

}  // namespace foldpar

// FP_CHECK(cond) or FP_CHECK(cond, "fmt {}", args...).
#define FP_CHECK(cond, ...)                                                            \
  do {                                                                                 \
    if (!(cond)) [[unlikely]]                                                          \
      ::foldpar::detail::check_failed(__FILE__, __LINE__, #cond __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)

// Aborts on a non-ok Status: for calls that cannot fail unless foldpar has a bug.
#define FP_CHECK_OK(expr)                                                          \
  do {                                                                             \
    ::foldpar::Status fp_check_status_ = (expr);                                   \
    if (!fp_check_status_.ok()) [[unlikely]]                                       \
      ::foldpar::fatal_error(__FILE__, __LINE__, fp_check_status_.to_string());    \
  } while (0)
