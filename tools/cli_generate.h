// `foldpar generate`: its flags and its run. Included by main.cc only, so that CLI11 stays
// in one translation unit. PLACEHOLDER until the generation issue lands: the subcommand
// exists and refuses to run.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "core/status.h"

namespace foldpar::cli {

struct GenerateArgs {
  std::string checkpoint;
};

inline CLI::App* add_generate(CLI::App& app, GenerateArgs& a) {
  CLI::App* cmd = app.add_subcommand("generate", "generate text from a checkpoint (not built yet)");
  cmd->add_option("--checkpoint", a.checkpoint, "a checkpoint directory");
  return cmd;
}

// Returns the exit code; `fail` prints a Status once per job and returns 2.
inline int run_generate(const GenerateArgs&, int (*fail)(const Status&)) {
  return fail(unimplemented("foldpar generate is not built yet"));
}

}  // namespace foldpar::cli
