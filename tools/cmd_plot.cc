// `foldpar plot`: loss, throughput and memory of a metrics file as PNGs (gnuplot; src/app/plot.h).
#include <cstdio>
#include <memory>

#include "app/plot.h"
#include "commands.h"

namespace foldpar::cli {
namespace {

struct PlotArgs {
  std::string metrics, out = "plots";
};

int run_plot_command(const PlotArgs& a) {
  Result<std::vector<std::string>> files = plot_metrics(a.metrics, a.out);
  if (!files.ok()) return fail(files.status());
  for (const std::string& f : *files) std::printf("%s\n", f.c_str());
  return kExitOk;
}

}  // namespace

Command add_plot_command(CLI::App& app) {
  auto a = std::make_shared<PlotArgs>();
  CLI::App* cmd = app.add_subcommand("plot", "draw loss, throughput and memory of a metrics file as PNG (gnuplot)");
  cmd->add_option("metrics", a->metrics, "metrics.jsonl of a training run")->required()->check(CLI::ExistingFile);
  cmd->add_option("-o,--out", a->out, "output directory");
  return {cmd, [a] { return run_plot_command(*a); }};
}

}  // namespace foldpar::cli
