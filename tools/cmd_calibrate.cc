// `foldpar calibrate`: measure this machine's hardware description (GEMM and attention
// rates, memory bandwidth, link latency and bandwidth) under mpirun -np 2; src/app/calibrate.h
// measures.
#include <cstdio>
#include <fstream>
#include <memory>

#include "app/calibrate.h"
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
  // The collectives against the ring model the timeline prices them with.
  for (size_t i = 0; i + 1 < h->measured.size(); ++i) {
    const auto& [key, s] = h->measured[i];
    if (h->measured[i + 1].first != key.substr(0, key.size() - 2) + "_ring_model_s") continue;
    std::fprintf(stderr, "%-28s measured %.3g s, ring model %.3g s\n", key.substr(0, key.size() - 2).c_str(), s,
                 h->measured[i + 1].second);
  }
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
