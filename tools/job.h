// One job start-up for every subcommand that runs under mpirun (verify --layout, train,
// generate, bench-layouts, calibrate, import): MPI with the environment's CommOptions, then
// the device on every rank before the first tensor exists. The world communicator is the
// runtime's; the Device outlives nothing it serves (members are destroyed device first,
// then MPI).
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "comm/mpi_runtime.h"
#include "core/status.h"
#include "device.h"

namespace foldpar::cli {

struct Job {
  std::unique_ptr<MpiRuntime> mpi;
  Device device;  // on the CPU: null backend and factory (the library defaults)

  Communicator& world() { return mpi->world(); }
  bool root() { return world().rank() == 0; }
};

// Collective over the job (on cuda, device selection agrees over the world: every rank fails
// if one has no GPU). `device` is the --device text: "cpu" or "cuda".
Result<Job> start_job(const std::string& device = "cpu");

// Adds `--device cpu|cuda` bound to `device`; `what` says where each rank runs.
CLI::Option* add_device_option(CLI::App* cmd, std::string& device, const std::string& what);

}  // namespace foldpar::cli
