// Metrics lines and the progress bar.
#include "train/progress.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

namespace foldpar {

Result<MetricsFile> MetricsFile::open(const std::string& path) {
  if (path.empty()) return MetricsFile(nullptr);
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr) return io_error("cannot open metrics file '{}': {}", path, std::strerror(errno));
  return MetricsFile(f);
}

MetricsFile::~MetricsFile() {
  if (file_ != nullptr) std::fclose(file_);
}

Status MetricsFile::append(const std::string& line) {
  if (file_ == nullptr) return Status();
  if (std::fprintf(file_, "%s\n", line.c_str()) < 0 || std::fflush(file_) != 0)
    return io_error("cannot append to the metrics file: {}", std::strerror(errno));
  return Status();
}

bool stdout_is_terminal() {
  bool launched = false;
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) launched = launched || std::getenv(var);
  if (!launched) return ::isatty(STDOUT_FILENO) != 0;
  const std::string parent_stdout = fmt::format("/proc/{}/fd/1", ::getppid());
  const int fd = ::open(parent_stdout.c_str(), O_WRONLY | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  const bool tty = ::isatty(fd) != 0;
  ::close(fd);
  return tty;
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

ProgressLine::ProgressLine(int64_t total_steps, bool tty, int64_t every)
    : total_(total_steps), tty_(tty), every_(std::max<int64_t>(0, every)) {}

void ProgressLine::update(int64_t step, double loss, double tokens_per_s, double elapsed_s) {
  const double eta = step > 0 ? elapsed_s / static_cast<double>(step) * static_cast<double>(total_ - step) : 0;
  if (tty_) {
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * step / std::max<int64_t>(1, total_));
    std::string bar(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(kWidth - filled), '.');
    std::fprintf(stdout, "\r[%s] step %lld/%lld  loss %.4f  %.0f tok/s  ETA %s   ", bar.c_str(),
                 static_cast<long long>(step), static_cast<long long>(total_), loss, tokens_per_s,
                 format_duration(eta).c_str());
    dirty_ = true;
  } else if (every_ > 0 && (step % every_ == 0 || step == total_)) {
    std::fprintf(stdout, "step %lld/%lld  loss %.4f  %.0f tok/s  ETA %s\n", static_cast<long long>(step),
                 static_cast<long long>(total_), loss, tokens_per_s, format_duration(eta).c_str());
  }
  std::fflush(stdout);
}

void ProgressLine::note(const std::string& text) {
  if (dirty_) std::fputc('\n', stdout);
  dirty_ = false;
  std::fprintf(stdout, "%s\n", text.c_str());
  std::fflush(stdout);
}

void ProgressLine::finish() {
  if (dirty_) std::fputc('\n', stdout);
  dirty_ = false;
  std::fflush(stdout);
}

}  // namespace foldpar
