// The foldpar program: parse, validate, build, run. All CLI11 use lives in this one
// translation unit (it is slow to compile); what each subcommand does lives in src/app/.
// Exit codes: 0 success, 1 a check failed (verify above tolerance), 2 bad input.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <memory>

#include "app/step_bench.h"
#include "app/verify.h"
#include "backend/backend.h"
#include "comm/mpi_runtime.h"
#include "core/status.h"

namespace foldpar {
namespace {

constexpr int kExitCheckFailed = 1;
constexpr int kExitBadInput = 2;

// Under mpirun every rank parses the same flags and reaches the same verdict on them; only
// the first rank prints, so a bad flag reads as one line. The launcher's environment tells
// the rank before MPI is initialized (OpenMPI, then PMIx/PMI launchers).
bool is_first_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const char* v = std::getenv(var)) return std::string(v) == "0";
  }
  return true;
}

int fail(const Status& s) {
  if (is_first_rank()) std::fprintf(stderr, "foldpar: error: %s\n", s.to_string().c_str());
  return kExitBadInput;
}

Result<Recompute> parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::kNone;
  if (name == "block") return Recompute::kBlock;
  return invalid_argument("--recompute must be none or block, got '{}'", name);
}

struct VerifyArgs {
  std::string model;
  uint64_t seed = 0;
  int64_t batch = 2, seq = 64;
  std::string recompute = "none";
  double tolerance = 0;
  std::string dump;
  bool json = false;
  std::string layout;
  std::string seq_split = "zigzag";
  bool no_overlap = false, keep_weights = false, keep_kv = false, sequence_parallel = false;
  int head_buckets = 1;
  std::string kv_exchange = "allgather";
};

void add_verify(CLI::App& app, VerifyArgs& a) {
  CLI::App* cmd = app.add_subcommand("verify", "compare the fast path's loss, logits and gradients with the reference");
  cmd->add_option("--model", a.model, "Hugging Face style config.json")->required();
  cmd->add_option("--seed", a.seed, "seed of the weights and tokens");
  cmd->add_option("--batch", a.batch, "sequences per batch (B)");
  cmd->add_option("--seq", a.seq, "tokens per sequence (S)");
  cmd->add_option("--recompute", a.recompute, "activation recomputation: none or block");
  cmd->add_option("--tolerance", a.tolerance, "largest relative error accepted (default: the f32 model tolerance)");
  cmd->add_option("--dump", a.dump, "write config, weights, batch, gradients and result to this directory");
  cmd->add_flag("--json", a.json, "print the report as JSON");
  cmd->add_option("--layout", a.layout, "parallel layout, e.g. tsp=4 (run under mpirun with as many ranks)");
  cmd->add_option("--seq-split", a.seq_split, "sequence sharding: zigzag or contiguous");
  cmd->add_flag("--no-overlap", a.no_overlap, "finish every transfer before the computation that follows it");
  cmd->add_flag("--keep-weights", a.keep_weights, "backward reuses the forward's attention shards");
  cmd->add_flag("--keep-kv", a.keep_kv, "backward reuses the forward's gathered K/V");
  cmd->add_option("--head-buckets", a.head_buckets, "tsp: all-gather each attention shard's K/V in this many buckets");
  cmd->add_flag("--sequence-parallel", a.sequence_parallel, "tp: Megatron sequence parallelism in the norm regions");
  cmd->add_option("--kv-exchange", a.kv_exchange, "sp: how attention exchanges K/V: allgather or ring");
}

Result<LayoutOptions::KvExchange> parse_kv_exchange(const std::string& name) {
  if (name == "allgather") return LayoutOptions::KvExchange::kAllGather;
  if (name == "ring") return LayoutOptions::KvExchange::kRing;
  return invalid_argument("--kv-exchange must be allgather or ring, got '{}'", name);
}

Result<SeqSplit> parse_seq_split(const std::string& name) {
  if (name == "zigzag") return SeqSplit::kZigzag;
  if (name == "contiguous") return SeqSplit::kContiguous;
  return invalid_argument("--seq-split must be zigzag or contiguous, got '{}'", name);
}

int run_verify_command(const VerifyArgs& a) {
  VerifyOptions o;
  Result<LlamaConfig> config = LlamaConfig::load(a.model);
  if (!config.ok()) return fail(config.status());
  Result<Recompute> rc = parse_recompute(a.recompute);
  if (!rc.ok()) return fail(rc.status());
  if (a.tolerance < 0) return fail(invalid_argument("--tolerance ({}) must not be negative", a.tolerance));
  o.config = config.value();
  o.seed = a.seed;
  o.batch = a.batch;
  o.seq = a.seq;
  o.recompute = rc.value();
  o.tolerance = a.tolerance;
  o.dump_dir = a.dump;
  if (a.layout.empty()) {
    Result<VerifyReport> report = run_verify(o);
    if (!report.ok()) return fail(report.status());
    std::fputs((a.json ? verify_report_json(*report) : verify_report_text(*report)).c_str(), stdout);
    return report->passed ? 0 : kExitCheckFailed;
  }
  Result<SeqSplit> split = parse_seq_split(a.seq_split);
  if (!split.ok()) return fail(split.status());
  Result<LayoutOptions::KvExchange> exchange = parse_kv_exchange(a.kv_exchange);
  if (!exchange.ok()) return fail(exchange.status());
  o.layout = a.layout;
  o.layout_options.split = split.value();
  o.layout_options.overlap = !a.no_overlap;
  o.layout_options.keep_weights = a.keep_weights;
  o.layout_options.keep_kv = a.keep_kv;
  o.layout_options.head_buckets = a.head_buckets;
  o.layout_options.sequence_parallel = a.sequence_parallel;
  o.layout_options.kv_exchange = exchange.value();
  Result<CommOptions> comm_options = CommOptions::from_env();
  if (!comm_options.ok()) return fail(comm_options.status());
  MpiRuntime mpi(nullptr, nullptr, comm_options.value());
  const bool leader = mpi.world_rank() == 0;
  Result<VerifyReport> report = run_verify_layout(o, mpi.world());
  // Every rank reaches the same result; rank 0 speaks for the job.
  if (!report.ok()) return fail(report.status());
  if (leader) std::fputs((a.json ? verify_report_json(*report) : verify_report_text(*report)).c_str(), stdout);
  return report->passed ? 0 : kExitCheckFailed;
}

struct BenchArgs {
  std::string model;
  int64_t batch = 1;
  std::vector<int64_t> seqs{1024};
  int steps = 3, warmup = 1, threads = 1;
  std::string recompute = "none";
  bool profile = false;
};

void add_bench(CLI::App& app, BenchArgs& a) {
  CLI::App* cmd = app.add_subcommand("bench", "time single-rank training steps (forward + backward)");
  cmd->add_option("--model", a.model, "Hugging Face style config.json")->required();
  cmd->add_option("--batch", a.batch, "sequences per batch (B)");
  cmd->add_option("--seq", a.seqs, "tokens per sequence (S); repeat or comma-separate for several")->delimiter(',');
  cmd->add_option("--steps", a.steps, "timed steps (median reported)");
  cmd->add_option("--warmup", a.warmup, "untimed steps first");
  cmd->add_option("--threads", a.threads, "BLAS threads");
  cmd->add_option("--recompute", a.recompute, "activation recomputation: none or block");
  cmd->add_flag("--profile", a.profile, "print the time spent in each backend op");
}

void print_profile(const StepBenchReport& r) {
  double total = 0;
  for (const auto& [op, t] : r.op_times) total += t.seconds;
  const double steps = static_cast<double>(r.step_seconds.size());
  for (const auto& [op, t] : r.op_times)
    std::printf("    %-24s %8.1f ms/step %6.1f%% %6lld calls/step\n", op.c_str(), 1e3 * t.seconds / steps,
                100.0 * t.seconds / total, static_cast<long long>(t.calls / static_cast<int64_t>(steps)));
  std::printf("    %-24s %8.1f ms/step (median step %.1f ms)\n", "all ops", 1e3 * total / steps,
              1e3 * r.median_seconds);
}

int run_bench_command(const BenchArgs& a) {
  Result<LlamaConfig> config = LlamaConfig::load(a.model);
  if (!config.ok()) return fail(config.status());
  Result<Recompute> rc = parse_recompute(a.recompute);
  if (!rc.ok()) return fail(rc.status());
  if (a.threads <= 0) return fail(invalid_argument("--threads ({}) must be positive", a.threads));
  set_cpu_backend_threads(a.threads);
  std::printf("%-8s %-6s %12s %12s %10s %14s\n", "seq", "batch", "step s", "tokens/s", "GFLOP/s", "peak MiB");
  for (int64_t seq : a.seqs) {
    StepBenchOptions o;
    o.config = config.value();
    o.batch = a.batch;
    o.seq = seq;
    o.steps = a.steps;
    o.warmup = a.warmup;
    o.recompute = rc.value();
    o.profile = a.profile;
    Result<StepBenchReport> r = run_step_bench(o);
    if (!r.ok()) return fail(r.status());
    std::printf("%-8lld %-6lld %12.3f %12.1f %10.1f %14.1f\n", static_cast<long long>(seq),
                static_cast<long long>(a.batch), r->median_seconds, r->tokens_per_second, r->gflops,
                static_cast<double>(r->memory.peak_total) / (1 << 20));
    if (a.profile) print_profile(*r);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace foldpar

int main(int argc, char** argv) {
  using namespace foldpar;
  CLI::App app{"foldpar: Tensor-and-Sequence Parallel training and serving of Llama models"};
  app.require_subcommand(1, 1);
  app.failure_message([](const CLI::App*, const CLI::Error& e) { return std::string(e.what()); });
  VerifyArgs verify_args;
  BenchArgs bench_args;
  add_verify(app, verify_args);
  add_bench(app, bench_args);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (is_first_rank()) std::fprintf(stderr, "foldpar: error: %s (see foldpar --help)\n", e.what());
    return kExitBadInput;
  }
  if (app.got_subcommand("verify")) return run_verify_command(verify_args);
  if (app.got_subcommand("bench")) return run_bench_command(bench_args);
  return kExitBadInput;
}
