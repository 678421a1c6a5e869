// Status and Result<T>: how foldpar reports the user's mistakes and recoverable failures.
// Library code returns these; only the program turns them into an exit code, by code
// (tools/cli.h: 2 for the user's mistakes, 3 for kIoError, 4 for kDiverged, 5 for kInternal).
// Broken invariants are not Statuses: they are FP_CHECK failures (core/check.h).
#pragma once

#include <fmt/format.h>

#include <string>
#include <utility>
#include <variant>

namespace foldpar {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // the user asked for something impossible (bad flag, sizes that do not divide)
  kNotFound,          // a named file, tensor or key does not exist
  kCorrupt,           // a file exists but its contents are malformed or lie about themselves
  kIoError,           // the OS refused a read or write
  kOutOfMemory,       // a request exceeds what may be allocated
  kUnimplemented,     // valid request, not supported by this build
  kInternal,          // a library outside foldpar failed in a recoverable way
  kDiverged,          // a training run met a non-finite loss or gradient (stopped before the update)
};

const char* status_code_name(StatusCode code);

// A cheap value: an ok Status holds no string.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: n_kv_heads (6) must be divisible by the TSP degree (4)"
  std::string to_string() const;

  // Returns a copy whose message is "context: message" (breadcrumbs up the call chain).
  Status with_context(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <typename... Args>
Status invalid_argument(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kInvalidArgument, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status corrupt(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kCorrupt, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status not_found(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kNotFound, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status io_error(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kIoError, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status diverged(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kDiverged, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Status unimplemented(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kUnimplemented, fmt::format(f, std::forward<Args>(args)...));
}

// Either a value or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}                 // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}          // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace foldpar

#define FP_CONCAT_INNER(a, b) a##b
#define FP_CONCAT(a, b) FP_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function when it is not ok.
#define FP_RETURN_IF_ERROR(expr)                      \
  do {                                                \
    ::foldpar::Status fp_status_ = (expr);            \
    if (!fp_status_.ok()) return fp_status_;          \
  } while (0)

// `FP_ASSIGN_OR_RETURN(auto x, make_x());` declares x from a Result or returns its Status.
#define FP_ASSIGN_OR_RETURN(lhs, expr) \
  FP_ASSIGN_OR_RETURN_IMPL(FP_CONCAT(fp_result_, __LINE__), lhs, expr)
#define FP_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
