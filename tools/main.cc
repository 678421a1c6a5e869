// The foldpar program: builds the CLI11 app from the subcommands (tools/cmd_*.cc), parses,
// and runs the chosen one. Exit codes by error class: tools/cli.h (and `foldpar --help`).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "cli.h"
#include "commands.h"
#include "core/heap_policy.h"

int main(int argc, char** argv) {
  using namespace foldpar::cli;
  foldpar::keep_freed_heap_memory();  // before any large block (core/heap_policy.h)
  CLI::App app{"foldpar: Tensor-and-Sequence Parallel training and serving of Llama models", "foldpar"};
  app.require_subcommand(1, 1);
  app.failure_message([](const CLI::App*, const CLI::Error& e) { return std::string(e.what()); });
  app.footer(exit_codes_help());
  const std::vector<Command> commands = {
      add_verify_command(app),    add_generate_command(app),       add_plan_command(app),
      add_bench_command(app),     add_bench_layouts_command(app),  add_calibrate_command(app),
      add_prepare_data_command(app), add_train_command(app),       add_plot_command(app),
      add_export_command(app),    add_import_command(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (is_first_rank()) std::fprintf(stderr, "foldpar: error: %s (see foldpar --help)\n", e.what());
    return kExitUsage;
  }
  for (const Command& c : commands)
    if (c.app->parsed()) return c.run();
  return kExitUsage;
}
