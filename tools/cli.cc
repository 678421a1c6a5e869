// Exit codes, the one-line error, and the CLI11 checks every subcommand uses.
#include "cli.h"

#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

namespace foldpar::cli {

int exit_code(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return kExitOk;
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kCorrupt:
    case StatusCode::kOutOfMemory:
    case StatusCode::kUnimplemented: return kExitUsage;
    case StatusCode::kIoError: return kExitIo;
    case StatusCode::kDiverged: return kExitDiverged;
    case StatusCode::kInternal: return kExitInternal;
  }
  return kExitInternal;
}

std::string exit_codes_help() {
  return fmt::format(
      "Exit codes:\n"
      "  {}  success\n"
      "  {}  a check failed (verify above its tolerance)\n"
      "  {}  the user's mistake: a bad flag, config, layout or size; a missing or corrupt input file\n"
      "  {}  an I/O failure: disk full, read-only file system, a write the OS refused\n"
      "  {}  the run diverged: a non-finite loss or gradient (the last checkpoint is untouched)\n"
      "  {}  a library foldpar uses failed (e.g. gnuplot)\n",
      kExitOk, kExitCheckFailed, kExitUsage, kExitIo, kExitDiverged, kExitInternal);
}

bool is_first_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const char* v = std::getenv(var)) return std::string(v) == "0";
  }
  return true;
}

int fail(const Status& s) {
  if (is_first_rank()) std::fprintf(stderr, "foldpar: error: %s\n", s.to_string().c_str());
  return exit_code(s.code());
}

namespace {

// A CLI11 check on the number an option's text holds (CLI11 reports conversion errors itself).
CLI::Validator number_check(bool (*ok)(double), const char* want, const char* desc) {
  return CLI::Validator(
      [ok, want](std::string& input) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(input, v)) return "must be a number, got '" + input + "'";
        return ok(v) ? std::string() : fmt::format("must be {}, got {}", want, input);
      },
      desc);
}

}  // namespace

CLI::Validator positive() {
  return number_check([](double v) { return v > 0; }, "positive", "POSITIVE");
}

CLI::Validator non_negative() {
  return number_check([](double v) { return v >= 0; }, "at least 0", "NONNEGATIVE");
}

CLI::Validator one_of(std::vector<std::string> names) {
  std::string listed, desc = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    listed += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
    desc += (i == 0 ? "" : ",") + names[i];
  }
  desc += "}";
  return CLI::Validator(
      [names, listed](std::string& input) -> std::string {
        for (const std::string& n : names)
          if (n == input) return {};
        return "must be " + listed + ", got '" + input + "'";
      },
      desc);
}

CLI::Option* add_recompute_option(CLI::App* cmd, Recompute& r) {
  return cmd->add_option("--recompute", r, "activation recomputation: none or block")
      ->transform(choice<Recompute>({{"none", Recompute::kNone}, {"block", Recompute::kBlock}}));
}

}  // namespace foldpar::cli
