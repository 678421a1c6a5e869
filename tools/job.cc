// The job start-up shared by the subcommands.
#include "job.h"

#include <utility>

#include "cli.h"

namespace foldpar::cli {

Result<Job> start_job(const std::string& device) {
  FP_ASSIGN_OR_RETURN(DeviceKind kind, parse_device(device));
  FP_ASSIGN_OR_RETURN(CommOptions options, CommOptions::from_env());
  Job job;
  job.mpi = std::make_unique<MpiRuntime>(nullptr, nullptr, options);
  FP_ASSIGN_OR_RETURN(job.device, open_job_device(kind, *job.mpi));  // before the first tensor
  return job;
}

CLI::Option* add_device_option(CLI::App* cmd, std::string& device, const std::string& what) {
  return cmd->add_option("--device", device, "cpu or cuda (" + what + ")")->check(one_of({"cpu", "cuda"}));
}

}  // namespace foldpar::cli
