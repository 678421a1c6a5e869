// The subcommands of the program, one source file each (tools/cmd_<name>.cc). Each adds its
// CLI11 subcommand with options bound into the library's options structs, and returns the
// Command main() runs when the user chose it.
#pragma once

#include <CLI/CLI.hpp>

#include "cli.h"

namespace foldpar::cli {

Command add_verify_command(CLI::App& app);        // cmd_verify.cc
Command add_train_command(CLI::App& app);         // cmd_train.cc
Command add_generate_command(CLI::App& app);      // cmd_generate.cc
Command add_plan_command(CLI::App& app);          // cmd_plan.cc
Command add_bench_command(CLI::App& app);         // cmd_bench.cc (and the old bench --layouts, --calibrate)
Command add_bench_layouts_command(CLI::App& app); // cmd_bench_layouts.cc
Command add_calibrate_command(CLI::App& app);     // cmd_calibrate.cc
Command add_prepare_data_command(CLI::App& app);  // cmd_prepare_data.cc
Command add_export_command(CLI::App& app);        // cmd_export.cc
Command add_import_command(CLI::App& app);        // cmd_import.cc
Command add_plot_command(CLI::App& app);          // cmd_plot.cc

}  // namespace foldpar::cli
