// `foldpar calibrate`: measure this machine's hardware description (GEMM and attention
// rates, link bandwidth and latency) under mpirun -np 2; src/app/layout_bench.h measures.
#include <cstdio>
#include <fstream>
#include <memory>

#include "app/layout_bench.h"
#include "cmd_bench_layouts.h"
#include "commands.h"
#include "job.h"

namespace foldpar::cli {

int run_calibrate(const std::string& out) {
  Result<Job> job = start_job();
  if (!job.ok()) return fail(job.status());
  set_cpu_backend_threads(1);
  Result<Hardware> h = calibrate_hardware(job->world());
  if (!h.ok()) return fail(h.status());
  if (!job->root()) return kExitOk;
  std::fputs(h->to_json().c_str(), stdout);
  if (!out.empty()) {
    std::ofstream f(out);
    f << h->to_json();
    if (!f) return fail(io_error("cannot write '{}'", out));
  }
  return kExitOk;
}

Command add_calibrate_command(CLI::App& app) {
  auto out = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("calibrate", "measure this machine's hardware description (mpirun -np 2)");
  cmd->add_option("--out", *out, "also write it to this JSON file (e.g. hardware/this-machine.json)");
  return {cmd, [out] { return run_calibrate(*out); }};
}

}  // namespace foldpar::cli
