// MPI start-up and shutdown: thread level, error handling, the fatal handler, process
// identity, host names, the watchdog and the world communicator.
#include "comm/mpi_runtime.h"

#include <fmt/format.h>

#include <cstring>

#include "comm/mpi_internal.h"
#include "comm/mpi_watchdog.h"
#include "core/check.h"
#include "core/log.h"

namespace foldpar {

namespace mpi_detail {

void mpi_call_failed(const char* file, int line, const char* call, int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) std::snprintf(text, sizeof text, "unknown MPI error");
  fatal_error(file, line, fmt::format("{} failed: {} (MPI error code {})", call, text, code));
}

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kBF16: return MPI_UINT16_T;
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
  }
  FP_CHECK(false, "dtype {}", static_cast<int>(dtype));
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
  }
  FP_CHECK(false, "reduce op {}", static_cast<int>(op));
  return MPI_OP_NULL;
}

}  // namespace mpi_detail

namespace {

// The fatal handler: end every rank of the job, not only this one.
void abort_job(int exit_code) { MPI_Abort(MPI_COMM_WORLD, exit_code); }

}  // namespace

MpiRuntime::MpiRuntime(int* argc, char*** argv, const CommOptions& options)
    : options_(options), ctx_(std::make_unique<mpi_detail::MpiContext>()) {
  int initialized = 0;
  FP_MPI_CHECK(MPI_Initialized(&initialized));
  FP_CHECK(!initialized, "MPI is already initialized: create one MpiRuntime per process");
  FP_CHECK(options.timeout_s >= 0, "watchdog timeout {} s", options.timeout_s);
  const bool watchdog = options.timeout_s > 0;
  const int wanted = watchdog ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED;
  int provided = 0;
  FP_MPI_CHECK(MPI_Init_thread(argc, argv, wanted, &provided));
  set_fatal_handler(&abort_job);
  FP_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  FP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &ctx_->world_rank));
  FP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &ctx_->world_size));

  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int host_length = 0;
  FP_MPI_CHECK(MPI_Get_processor_name(host, &host_length));
  set_process_identity(fmt::format("rank {} on {}", ctx_->world_rank, host));
  std::vector<char> hosts(static_cast<size_t>(ctx_->world_size) * MPI_MAX_PROCESSOR_NAME);
  FP_MPI_CHECK(MPI_Allgather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR,
                             MPI_COMM_WORLD));
  for (int r = 0; r < ctx_->world_size; ++r) {
    const char* name = &hosts[static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME];
    ctx_->hosts.emplace_back(name, strnlen(name, MPI_MAX_PROCESSOR_NAME));
  }

  ctx_->check.store(options.check);
  ctx_->pairwise_reduce_scatter = options.reduce_scatter == CommOptions::ReduceScatterAlgorithm::kPairwise;
  if (watchdog) {
    const bool can_query = provided >= MPI_THREAD_MULTIPLE;
    if (!can_query && ctx_->world_rank == 0) {
      log_warn("MPI provides no MPI_THREAD_MULTIPLE: the watchdog will report hangs without asking peers");
    }
    ctx_->watchdog = std::make_unique<mpi_detail::MpiWatchdog>(*ctx_, options.timeout_s, can_query);
  }
  world_ = mpi_detail::make_mpi_communicator(ctx_.get(), MPI_COMM_WORLD, "world");
}

MpiRuntime::~MpiRuntime() {
  world_.reset();
  FP_CHECK(ctx_->live_comms.load() == 0, "{} communicators outlive the MpiRuntime", ctx_->live_comms.load());
  ctx_->watchdog.reset();
  FP_MPI_CHECK(MPI_Finalize());
  set_fatal_handler(nullptr);
}

int MpiRuntime::world_rank() const { return ctx_->world_rank; }
int MpiRuntime::world_size() const { return ctx_->world_size; }
const std::string& MpiRuntime::host() const { return ctx_->hosts[ctx_->world_rank]; }
int MpiRuntime::local_rank() const {
  int local = 0;
  for (int r = 0; r < ctx_->world_rank; ++r) local += ctx_->hosts[r] == host() ? 1 : 0;
  return local;
}
bool MpiRuntime::watchdog_enabled() const { return ctx_->watchdog != nullptr; }
void MpiRuntime::set_check(bool on) { ctx_->check.store(on); }

}  // namespace foldpar
