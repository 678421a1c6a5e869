// Flag parsing for the bench programs: CLI11, as in the foldpar program. parse_flags prints
// --help or one error line and tells main what to return: 0 after --help, 2 for a bad flag
// (the project's exit code for the user's mistakes). Timing lives in core/timing.h.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

namespace foldpar::bench {

// For counts, sizes and durations: "'abc' is not a number", "must be positive, got 0".
inline const CLI::Validator kPositive(
    [](std::string& s) -> std::string {
      char* end = nullptr;
      const double v = std::strtod(s.c_str(), &end);
      if (end == s.c_str() || *end != '\0') return "'" + s + "' is not a number";
      if (!(v > 0)) return "must be positive, got " + s;
      return {};
    },
    "POSITIVE");

// nullopt: go on. Otherwise the code main returns. `print` false keeps a rank quiet (under
// MPI every rank parses, one prints).
inline std::optional<int> parse_flags(CLI::App& app, int argc, char** argv, bool print = true) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    if (print) app.exit(e);
    return 0;
  } catch (const CLI::ParseError& e) {
    if (print) std::fprintf(stderr, "%s: error: %s (see --help)\n", app.get_name().c_str(), e.what());
    return 2;
  }
  return std::nullopt;
}

}  // namespace foldpar::bench
