// The foldpar program: parse, validate, build, run. All CLI11 use lives in this one
// translation unit (it is slow to compile); what each subcommand does lives in src/app/,
// src/train/ and src/data/. Exit codes: 0 success, 1 a check failed (verify above
// tolerance), 2 bad input (one line naming the problem; under mpirun printed once).
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "app/plot.h"
#include "cli_generate.h"
#include "cli_bench_layouts.h"
#include "cli_plan.h"
#include "device.h"
#include "app/step_bench.h"
#include "app/verify.h"
#include "backend/backend.h"
#include "backend/cpu/gemm_engine.h"
#include "comm/mpi_runtime.h"
#include "core/status.h"
#include "data/corpus.h"
#include "parallel/sharded_weights.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

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

// ---- flags shared by verify, train and bench: the layout and its strategy's knobs ----
struct LayoutArgs {
  std::string layout;
  std::string seq_split = "zigzag";
  std::string recompute = "none";
  std::string kv_exchange = "allgather";
  bool no_overlap = false, keep_weights = false, keep_kv = false, sequence_parallel = false;
  int head_buckets = 1;
};

void add_layout_flags(CLI::App* cmd, LayoutArgs& a) {
  cmd->add_option("--layout", a.layout, "parallel layout, e.g. tsp=4, tp=2,sp=2, dp=2,tsp=2 (run under mpirun)");
  cmd->add_option("--recompute", a.recompute, "activation recomputation: none or block");
  cmd->add_option("--seq-split", a.seq_split, "sequence sharding (tsp, sp, tp x sp): zigzag or contiguous");
  cmd->add_flag("--no-overlap", a.no_overlap, "finish every transfer before the computation that follows it");
  cmd->add_flag("--keep-weights", a.keep_weights, "tsp: backward reuses the forward's attention shards");
  cmd->add_flag("--keep-kv", a.keep_kv, "tsp: backward reuses the forward's gathered K/V");
  cmd->add_option("--head-buckets", a.head_buckets, "tsp: all-gather each attention shard's K/V in this many buckets");
  cmd->add_flag("--sequence-parallel", a.sequence_parallel, "tp, tp x sp: Megatron sequence parallelism in the norm regions");
  cmd->add_option("--kv-exchange", a.kv_exchange, "sp, tp x sp: how attention exchanges K/V: allgather or ring");
}

Result<Recompute> parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::kNone;
  if (name == "block") return Recompute::kBlock;
  return invalid_argument("--recompute must be none or block, got '{}'", name);
}

Result<LayoutOptions> layout_options(const LayoutArgs& a) {
  LayoutOptions o;
  if (a.seq_split == "zigzag") {
    o.split = SeqSplit::kZigzag;
  } else if (a.seq_split == "contiguous") {
    o.split = SeqSplit::kContiguous;
  } else {
    return invalid_argument("--seq-split must be zigzag or contiguous, got '{}'", a.seq_split);
  }
  if (a.kv_exchange == "allgather") {
    o.kv_exchange = LayoutOptions::KvExchange::kAllGather;
  } else if (a.kv_exchange == "ring") {
    o.kv_exchange = LayoutOptions::KvExchange::kRing;
  } else {
    return invalid_argument("--kv-exchange must be allgather or ring, got '{}'", a.kv_exchange);
  }
  FP_ASSIGN_OR_RETURN(o.recompute, parse_recompute(a.recompute));
  o.overlap = !a.no_overlap;
  o.keep_weights = a.keep_weights;
  o.keep_kv = a.keep_kv;
  o.head_buckets = a.head_buckets;
  o.sequence_parallel = a.sequence_parallel;
  return o;
}

Result<MpiRuntime*> start_mpi(std::unique_ptr<MpiRuntime>& holder) {
  FP_ASSIGN_OR_RETURN(CommOptions options, CommOptions::from_env());
  holder = std::make_unique<MpiRuntime>(nullptr, nullptr, options);
  return holder.get();
}

// ---- verify ----
struct VerifyArgs {
  std::string model;
  uint64_t seed = 0;
  int64_t batch = 2, seq = 64;
  double tolerance = 0;
  std::string dump;
  bool json = false;
  LayoutArgs layout;
};

void add_verify(CLI::App& app, VerifyArgs& a) {
  CLI::App* cmd = app.add_subcommand("verify", "compare the fast path's loss, logits and gradients with the reference");
  cmd->add_option("--model", a.model, "Hugging Face style config.json")->required();
  cmd->add_option("--seed", a.seed, "seed of the weights and tokens");
  cmd->add_option("--batch", a.batch, "sequences per batch (B)");
  cmd->add_option("--seq", a.seq, "tokens per sequence (S)");
  cmd->add_option("--tolerance", a.tolerance, "largest relative error accepted (default: the f32 model tolerance)");
  cmd->add_option("--dump", a.dump, "write config, weights, batch, gradients and result to this directory");
  cmd->add_flag("--json", a.json, "print the report as JSON");
  add_layout_flags(cmd, a.layout);
}

int run_verify_command(const VerifyArgs& a) {
  Result<LlamaConfig> config = LlamaConfig::load(a.model);
  if (!config.ok()) return fail(config.status());
  Result<LayoutOptions> lo = layout_options(a.layout);
  if (!lo.ok()) return fail(lo.status());
  if (a.tolerance < 0) return fail(invalid_argument("--tolerance ({}) must not be negative", a.tolerance));
  VerifyOptions o;
  o.config = config.value();
  o.seed = a.seed;
  o.batch = a.batch;
  o.seq = a.seq;
  o.recompute = lo->recompute;
  o.tolerance = a.tolerance;
  o.dump_dir = a.dump;
  o.layout = a.layout.layout;
  o.layout_options = lo.value();
  std::unique_ptr<MpiRuntime> mpi;
  Result<VerifyReport> report = Status();
  if (a.layout.layout.empty()) {
    report = run_verify(o);
  } else {
    Result<MpiRuntime*> rt = start_mpi(mpi);
    if (!rt.ok()) return fail(rt.status());
    report = run_verify_layout(o, (*rt)->world());
  }
  if (!report.ok()) return fail(report.status());
  if (is_first_rank()) std::fputs((a.json ? verify_report_json(*report) : verify_report_text(*report)).c_str(), stdout);
  return report->passed ? 0 : kExitCheckFailed;
}

// ---- bench ----
struct BenchArgs {
  std::string model;
  int64_t batch = 1;
  std::vector<int64_t> seqs{1024};
  int steps = 3, warmup = 1, threads = 1;
  std::string recompute = "none", device = "cpu";
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
  cmd->add_option("--device", a.device, "cpu or cuda (GPU 0; built with -DFOLDPAR_WITH_CUDA=ON); not with --layouts");
}

// The CPU GEMM engine the steps run on (backend/cpu/gemm_engine.h), and its warning if any.
void print_gemm_engine() {
  const GemmEngineReport& g = gemm_engine_report();
  std::printf("%s\n", g.summary().c_str());
  if (!g.warning.empty()) std::fprintf(stderr, "warning: %s\n", g.warning.c_str());
}

void print_profile(const StepBenchReport& r) {
  double total = 0;
  for (const auto& [op, t] : r.op_times) total += t.seconds;
  const double steps = static_cast<double>(r.step_seconds.size());
  for (const auto& [op, t] : r.op_times)
    std::printf("    %-24s %8.1f ms/step %6.1f%% %6lld calls/step\n", op.c_str(), 1e3 * t.seconds / steps,
                100.0 * t.seconds / total, static_cast<long long>(t.calls / static_cast<int64_t>(steps)));
  std::printf("    %-24s %8.1f ms/step (median step %.1f ms)\n", "all ops", 1e3 * total / steps, 1e3 * r.median_seconds);
}

int run_bench_command(const BenchArgs& a) {
  Result<LlamaConfig> config = LlamaConfig::load(a.model);
  if (!config.ok()) return fail(config.status());
  Result<Recompute> rc = parse_recompute(a.recompute);
  if (!rc.ok()) return fail(rc.status());
  if (a.threads <= 0) return fail(invalid_argument("--threads ({}) must be positive", a.threads));
  Result<cli::DeviceKind> kind = cli::parse_device(a.device);
  if (!kind.ok()) return fail(kind.status());
  Result<cli::Device> device = cli::open_device(*kind, 0);
  if (!device.ok()) return fail(device.status());
  set_cpu_backend_threads(a.threads);
  if (device->backend == nullptr) print_gemm_engine();
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
    o.backend = device->backend.get();
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

// ---- prepare-data ----
struct PrepareArgs {
  std::vector<std::string> inputs;
  std::string out;
  std::string tokenizer;
};

void add_prepare(CLI::App& app, PrepareArgs& a) {
  CLI::App* cmd = app.add_subcommand("prepare-data", "turn text files into token files (train.tokens, val.tokens)");
  cmd->add_option("--input", a.inputs, "text files or directories (default: Debian's fortunes)");
  cmd->add_option("--out", a.out, "output directory")->required();
  cmd->add_option("--tokenizer", a.tokenizer, "a SentencePiece model (default: bytes)");
}

int run_prepare_command(const PrepareArgs& a) {
  PrepareOptions o;
  o.inputs = a.inputs;
  o.out_dir = a.out;
  o.tokenizer = a.tokenizer;
  Result<PrepareReport> r = prepare_corpus(o);
  if (!r.ok()) return fail(r.status());
  std::printf("%lld files, %lld documents, %lld bytes -> %lld training and %lld validation tokens (%s, vocabulary %u) in %s\n",
              static_cast<long long>(r->files), static_cast<long long>(r->documents), static_cast<long long>(r->bytes),
              static_cast<long long>(r->train_tokens), static_cast<long long>(r->val_tokens), r->tokenizer.c_str(),
              r->vocab_size, a.out.c_str());
  return 0;
}

// ---- train ----
struct TrainArgs {
  std::string model, data, out = "out/train", init_from;
  int64_t seq = 256, batch = 8, micro_batch = 0, steps = 100, stop_after = 0;
  int64_t eval_every = 50, eval_batches = 4, checkpoint_every = 0, print_every = 10;
  int keep = 2;
  uint64_t seed = 0;
  bool resume = false;
  std::string progress = "auto", device = "cpu";
  bool bf16 = false;
  OptimizerConfig optimizer;
  LayoutArgs layout;
};

void add_train(CLI::App& app, TrainArgs& a) {
  CLI::App* cmd = app.add_subcommand("train", "train a model on any layout (run under mpirun)");
  cmd->add_option("--model", a.model, "Hugging Face style config.json")->required();
  cmd->add_option("--data", a.data, "a prepared corpus (default: Debian's fortunes, prepared into OUT/data)");
  cmd->add_option("--out", a.out, "output directory: metrics.jsonl, checkpoints/");
  cmd->add_option("--seq", a.seq, "tokens per sequence (S)");
  cmd->add_option("--batch", a.batch, "sequences per optimizer step (global)");
  cmd->add_option("--micro-batch", a.micro_batch, "sequences per forward per data-parallel rank (default: all)");
  cmd->add_option("--steps", a.steps, "optimizer steps (the learning-rate schedule spans them)");
  cmd->add_option("--stop-after", a.stop_after, "stop with a checkpoint after this step (resume later)");
  cmd->add_option("--lr", a.optimizer.lr, "peak learning rate");
  cmd->add_option("--min-lr", a.optimizer.min_lr, "learning rate at the end of the cosine decay");
  cmd->add_option("--warmup", a.optimizer.warmup_steps, "linear warmup steps");
  cmd->add_option("--weight-decay", a.optimizer.weight_decay, "AdamW decoupled weight decay (not on norms)");
  cmd->add_option("--grad-clip", a.optimizer.grad_clip, "clip the global gradient norm to this (0: off)");
  cmd->add_option("--seed", a.seed, "seed of the weights and the data order");
  cmd->add_option("--eval-every", a.eval_every, "validation loss every this many steps");
  cmd->add_option("--eval-batches", a.eval_batches, "validation batches");
  cmd->add_option("--checkpoint-every", a.checkpoint_every, "checkpoint every this many steps (0: at the end)");
  cmd->add_option("--keep-checkpoints", a.keep, "complete checkpoints kept");
  cmd->add_option("--print-every", a.print_every, "with --progress lines: a progress line this often");
  cmd->add_option("--progress", a.progress,
                  "auto (a bar on a terminal; under mpirun ranks always see one), bar, lines or none");
  cmd->add_flag("--resume", a.resume, "continue from the newest complete checkpoint in OUT");
  cmd->add_flag("--bf16", a.bf16, "store weights and activations in bf16 (f32 master weights); tsp layouts");
  cmd->add_option("--init-from", a.init_from, "start from a Hugging Face directory (config.json + model.safetensors)");
  cmd->add_option("--device", a.device, "cpu or cuda (each rank: GPU local rank mod GPUs; docs/GPU.md)");
  add_layout_flags(cmd, a.layout);
}

// Rank 0 prepares the default corpus once; the others wait.
Result<std::string> default_corpus(const std::string& out, Communicator& world) {
  const std::string dir = (std::filesystem::path(out) / "data").string();
  Status s;
  if (world.rank() == 0 && !read_corpus_info(dir).ok()) {
    PrepareOptions p;
    p.out_dir = dir;
    s = prepare_corpus(p).status();
  }
  int32_t failed = s.ok() ? 0 : 1;
  FP_CHECK_OK(world.all_reduce(&failed, &failed, 1, DType::kI32, ReduceOp::kMax));
  if (!s.ok()) return s;
  if (failed) return io_error("rank 0 could not prepare the default corpus");
  return dir;
}

int run_train_command(const TrainArgs& a) {
  Result<LlamaConfig> config = LlamaConfig::load(a.model);
  if (!config.ok()) return fail(config.status());
  Result<LayoutOptions> lo = layout_options(a.layout);
  if (!lo.ok()) return fail(lo.status());
  Result<cli::DeviceKind> kind = cli::parse_device(a.device);
  if (!kind.ok()) return fail(kind.status());
  std::unique_ptr<MpiRuntime> mpi;
  Result<MpiRuntime*> rt = start_mpi(mpi);
  if (!rt.ok()) return fail(rt.status());
  Communicator& world = (*rt)->world();
  Result<cli::Device> device = cli::open_job_device(*kind, **rt);  // before the first tensor
  if (!device.ok()) return fail(device.status());
  TrainOptions o;
  o.backend = device->backend.get();
  o.axis_comm = device->axis_comm;
  o.config = config.value();
  o.layout = a.layout.layout;
  o.layout_options = lo.value();
  if (a.bf16) o.layout_options.dtype = DType::kBF16;
  o.seq = a.seq;
  o.batch = a.batch;
  o.micro_batch = a.micro_batch;
  o.steps = a.steps;
  o.stop_after = a.stop_after;
  o.optimizer = a.optimizer;
  o.optimizer.total_steps = a.steps;
  o.seed = a.seed;
  o.out_dir = a.out;
  o.eval_every = a.eval_every;
  o.eval_batches = a.eval_batches;
  o.checkpoint_every = a.checkpoint_every;
  o.keep_checkpoints = a.keep;
  o.resume = a.resume;
  o.init_from = a.init_from;
  o.print_every = a.print_every;
  if (a.progress == "auto") {
    o.tty = ::isatty(STDOUT_FILENO) != 0;
  } else if (a.progress == "bar" || a.progress == "lines" || a.progress == "none") {
    o.tty = a.progress == "bar";
    if (a.progress == "none") o.print_every = 0;
  } else {
    return fail(invalid_argument("--progress must be auto, bar, lines or none, got '{}'", a.progress));
  }
  Result<std::string> data = a.data.empty() ? default_corpus(a.out, world) : Result<std::string>(a.data);
  if (!data.ok()) return fail(data.status());
  o.data_dir = data.value();
  Result<TrainReport> r = run_training(o, world);
  if (!r.ok()) return fail(r.status());
  if (world.rank() == 0)
    std::printf("trained to step %lld (%lld steps here): loss %.4f, validation loss %.4f, %.0f tokens/s; checkpoint %s\n",
                static_cast<long long>(r->final_step), static_cast<long long>(r->steps_done), r->last_loss, r->val_loss,
                r->tokens_per_second, r->checkpoint.c_str());
  return 0;
}

// ---- plot, export, import ----
struct PlotArgs {
  std::string metrics, out = "plots";
};

int run_plot_command(const PlotArgs& a) {
  Result<std::vector<std::string>> files = plot_metrics(a.metrics, a.out);
  if (!files.ok()) return fail(files.status());
  for (const std::string& f : *files) std::printf("%s\n", f.c_str());
  return 0;
}

struct ExportArgs {
  std::string checkpoint, out;
};

// A checkpoint (any layout) read as one rank's full model and written as a Hugging Face directory.
int run_export_command(const ExportArgs& a) {
  Result<CheckpointState> st = read_checkpoint_state(a.checkpoint);
  if (!st.ok()) return fail(st.status());
  LlamaWeights w = LlamaWeights::allocate(st->config, DType::kF32, MemCategory::kParameters);
  LlamaWeights g = LlamaWeights::allocate(st->config, DType::kF32, MemCategory::kGradients);
  std::vector<ParamRef> refs = replicated_param_refs(w, g, true);
  if (Status s = load_checkpoint(a.checkpoint, st->config, refs, nullptr, nullptr); !s.ok()) return fail(s);
  if (Status s = write_hf_directory(a.out, st->config, w); !s.ok()) return fail(s);
  std::printf("exported step %lld of %s to %s\n", static_cast<long long>(st->step), a.checkpoint.c_str(), a.out.c_str());
  return 0;
}

struct ImportArgs {
  std::string hf, out;
};

// A Hugging Face directory becomes step 0 of a training directory: `train --resume --out OUT`
// then starts from it under any layout (fresh optimizer state).
int run_import_command(const ImportArgs& a) {
  Result<LlamaConfig> config = LlamaConfig::load((std::filesystem::path(a.hf) / "config.json").string());
  if (!config.ok()) return fail(config.status());
  LlamaWeights w = LlamaWeights::allocate(*config, DType::kF32, MemCategory::kParameters);
  LlamaWeights g = LlamaWeights::allocate(*config, DType::kF32, MemCategory::kGradients);
  std::vector<ParamRef> refs = replicated_param_refs(w, g, true);
  if (Status s = load_hf_weights(a.hf, *config, refs); !s.ok()) return fail(s);
  std::vector<Tensor> m, v;
  for (const ParamRef& p : refs) {
    m.push_back(Tensor::zeros(p.param.shape(), DType::kF32, MemCategory::kOptimizer));
    v.push_back(Tensor::zeros(p.param.shape(), DType::kF32, MemCategory::kOptimizer));
  }
  std::unique_ptr<MpiRuntime> mpi;
  Result<MpiRuntime*> rt = start_mpi(mpi);
  if (!rt.ok()) return fail(rt.status());
  CheckpointState st{0, 0, 0, "imported", *config};
  Result<std::string> dir = save_checkpoint((std::filesystem::path(a.out) / "checkpoints").string(), st,
                                            CheckpointWrite{&refs, &m, &v, true, 2}, (*rt)->world());
  if (!dir.ok()) return fail(dir.status());
  std::printf("imported %s as %s\n", a.hf.c_str(), dir->c_str());
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
  PrepareArgs prepare_args;
  TrainArgs train_args;
  PlotArgs plot_args;
  ExportArgs export_args;
  ImportArgs import_args;
  cli::GenerateArgs generate_args;
  cli::PlanArgs plan_args;
  cli::BenchLayoutsArgs bench_layouts_args;
  add_verify(app, verify_args);
  cli::add_generate(app, generate_args);
  cli::add_plan(app, plan_args);
  add_bench(app, bench_args);
  cli::add_bench_layouts(app.get_subcommand("bench"), bench_layouts_args);
  add_prepare(app, prepare_args);
  add_train(app, train_args);
  CLI::App* plot = app.add_subcommand("plot", "draw loss, throughput and memory of a metrics file as PNG (gnuplot)");
  plot->add_option("metrics", plot_args.metrics, "metrics.jsonl of a training run")->required();
  plot->add_option("-o,--out", plot_args.out, "output directory");
  CLI::App* exp = app.add_subcommand("export", "write a checkpoint as a Hugging Face directory");
  exp->add_option("--checkpoint", export_args.checkpoint, "a checkpoint directory (step-N)")->required();
  exp->add_option("-o,--out", export_args.out, "output directory")->required();
  CLI::App* imp = app.add_subcommand("import", "make a Hugging Face directory step 0 of a training directory");
  imp->add_option("--hf", import_args.hf, "directory with config.json and model.safetensors")->required();
  imp->add_option("-o,--out", import_args.out, "training directory (train --resume --out DIR continues)")->required();
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
  if (app.got_subcommand("bench") && bench_layouts_args.active() && bench_args.device != "cpu")
    return fail(invalid_argument("bench --layouts and --calibrate run on the CPU only, not --device {}",
                                 bench_args.device));
  if (app.got_subcommand("bench") && bench_layouts_args.active())
    return cli::run_bench_layouts(bench_layouts_args, bench_args, fail);
  if (app.got_subcommand("bench") && bench_args.model.empty()) return fail(invalid_argument("bench: --model is required"));
  if (app.got_subcommand("bench")) return run_bench_command(bench_args);
  if (app.got_subcommand("prepare-data")) return run_prepare_command(prepare_args);
  if (app.got_subcommand("train")) return run_train_command(train_args);
  if (app.got_subcommand("plot")) return run_plot_command(plot_args);
  if (app.got_subcommand("export")) return run_export_command(export_args);
  if (app.got_subcommand("import")) return run_import_command(import_args);
  if (app.got_subcommand("generate")) return cli::run_generate(generate_args, fail);
  if (app.got_subcommand("plan")) return cli::run_plan(plan_args, fail);
  return kExitBadInput;
}
