// What a training run shows and records: one JSON line per step appended to a metrics file,
// and on rank 0 a progress bar (step, loss, tokens/s, ETA) redrawn in place on a terminal,
// plain lines otherwise.
#pragma once

#include <cstdio>
#include <string>

#include "core/status.h"

namespace foldpar {

class MetricsFile {
 public:
  // Appends to `path` (created if missing; an empty path disables writing).
  static Result<MetricsFile> open(const std::string& path);
  MetricsFile(MetricsFile&& o) noexcept : file_(o.file_) { o.file_ = nullptr; }
  MetricsFile(const MetricsFile&) = delete;
  ~MetricsFile();
  // One line of JSON text (no newline inside), flushed at once so a crash loses nothing.
  Status append(const std::string& json_line);

 private:
  explicit MetricsFile(std::FILE* f) : file_(f) {}
  std::FILE* file_ = nullptr;
};

class ProgressLine {
 public:
  // tty: redraw one line with \r; otherwise print a line every `every` steps.
  ProgressLine(int64_t total_steps, bool tty, int64_t every);
  void update(int64_t step, double loss, double tokens_per_s, double elapsed_s);
  void note(const std::string& text);  // a line of its own (validation loss, checkpoints)
  void finish();

 private:
  int64_t total_;
  bool tty_;
  int64_t every_;
  bool dirty_ = false;
};

// Whether the user watches this process's stdout on a terminal: what `--progress auto`
// draws the bar on. Under a launcher (mpirun) a rank's stdout is the launcher's pseudo-
// terminal whatever the user redirected, so there it asks about the stdout of the process
// that started the rank (mpirun on one host); when that cannot be read, no terminal.
bool stdout_is_terminal();

// "1h02m", "3m05s", "42s".
std::string format_duration(double seconds);

}  // namespace foldpar
