// What every subcommand of the program shares: exit codes by error class, printing an error
// once per job, the CLI11 checks and enum transformers with one-line messages that name the
// value, and the Command record main() dispatches on. No subcommand's logic lives here.
//
// Exit codes (README.md "Exit codes", `foldpar --help`): 0 success; 1 a check failed (verify
// above tolerance); 2 the user's mistake (bad flag, config, sizes, a corrupt or missing input
// file); 3 an I/O failure (disk full, read-only file system, a write refused); 4 the run
// diverged (a non-finite loss or gradient); 5 a library foldpar uses failed.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "model/llama_model.h"

namespace foldpar::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitIo = 3;
inline constexpr int kExitDiverged = 4;
inline constexpr int kExitInternal = 5;

// The one place a Status becomes an exit code.
int exit_code(StatusCode code);

// The table of exit codes, as `foldpar --help` prints it.
std::string exit_codes_help();

// Under mpirun every rank reaches the same verdict on its flags; only the first prints, so a
// bad flag reads as one line. The launcher's environment tells the rank before MPI starts.
bool is_first_rank();

// Prints "foldpar: error: <status>" (first rank only) and returns exit_code(s.code()).
int fail(const Status& s);

// A subcommand: its CLI11 node, and what runs when the user chose it (returns the exit code).
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

// Checks for numeric options; CLI11 reports "--seq: must be positive, got 0".
CLI::Validator positive();
CLI::Validator non_negative();

// A transformer from names to an enum: `--recompute none|block`. An unknown name fails with
// "--recompute: must be none or block, got 'sometimes'".
template <typename E>
CLI::Validator choice(std::vector<std::pair<std::string, E>> names) {
  std::string listed;
  for (size_t i = 0; i < names.size(); ++i)
    listed += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i].first;
  std::string desc = "{";
  for (size_t i = 0; i < names.size(); ++i) desc += (i == 0 ? "" : ",") + names[i].first;
  desc += "}";
  return CLI::Validator(
      [names, listed](std::string& input) -> std::string {
        for (const auto& [name, value] : names) {
          if (name == input) {
            input = std::to_string(static_cast<long long>(value));
            return {};
          }
        }
        return "must be " + listed + ", got '" + input + "'";
      },
      desc);
}

// The names for one option's values when they are plain strings checked against a list.
CLI::Validator one_of(std::vector<std::string> names);

// Adds `--recompute none|block` bound to `r`.
CLI::Option* add_recompute_option(CLI::App* cmd, Recompute& r);

}  // namespace foldpar::cli
