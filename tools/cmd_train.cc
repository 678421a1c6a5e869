// `foldpar train`: training on any layout under mpirun (src/train/trainer.h). Without --data
// rank 0 first prepares Debian's fortunes into OUT/data.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli_layout.h"
#include "commands.h"
#include "core/check.h"
#include "data/corpus.h"
#include "fault_injection.h"
#include "job.h"
#include "parallel/failed_ranks.h"
#include "train/progress.h"
#include "train/trainer.h"

namespace foldpar::cli {
namespace {

enum class Progress { kAuto, kBar, kLines, kNone };

struct TrainArgs {
  std::string model, device = "cpu";
  TrainOptions options;  // config, layout, data, backend and progress filled at run time
  Progress progress = Progress::kAuto;
  bool bf16 = false, f32 = false;
  LayoutArgs layout;
};

// Rank 0 prepares the default corpus once; the others wait.
Result<std::string> default_corpus(const std::string& out, Communicator& world) {
  const std::string dir = (std::filesystem::path(out) / "data").string();
  Status s;
  if (world.rank() == 0 && !read_corpus_info(dir).ok()) {
    PrepareOptions p;
    p.out_dir = dir;
    s = prepare_corpus(p).status();
  }
  const PhaseVerdict v = agree_on_phase(world, s);
  if (!s.ok()) return s;
  if (!v.ok()) return Status(v.first_code, "rank 0 could not prepare the default corpus");
  return dir;
}

// The options the flags do not bind directly: the config, the layout, the progress display.
// `ranks`: the job's, for the default layout tsp=<ranks>; `terminal`: whether the user
// watches a terminal (asked before MPI starts, which sets the launcher's variables).
Result<TrainOptions> train_options(const TrainArgs& a, int ranks, bool terminal) {
  TrainOptions o = a.options;
  FP_ASSIGN_OR_RETURN(o.config, LlamaConfig::load(a.model));
  FP_ASSIGN_OR_RETURN(o.layout, layout_of(a.layout, ranks));
  // bf16 storage with f32 masters: asked for, or the default on a GPU (where f32 runs on the
  // CUDA cores at a fifteenth of the tensor cores' rate) unless --f32 says otherwise.
  if (a.bf16 && a.f32) return invalid_argument("--bf16 and --f32 exclude each other");
  if (a.f32 && o.layout->dtype == DType::kBF16)
    return invalid_argument("--f32 with the bf16 layout {}", o.layout->to_string());
  if (a.bf16 || (a.device == "cuda" && !a.f32)) o.layout->dtype = DType::kBF16;
  o.checkpoint_hooks = checkpoint_hooks_from_env();
  o.optimizer.total_steps = o.steps;
  o.tty = a.progress == Progress::kBar || (a.progress == Progress::kAuto && terminal);
  if (a.progress == Progress::kNone) o.print_every = 0;
  return o;
}

int run_train_command(const TrainArgs& a) {
  const bool terminal = stdout_is_terminal();
  Result<Job> job = start_job(a.device);
  if (!job.ok()) return fail(job.status());
  Communicator& world = job->world();
  Result<TrainOptions> o = train_options(a, world.size(), terminal);
  if (!o.ok()) return fail(o.status());
  o->backend = job->device.backend.get();
  o->axis_comm = job->device.axis_comm;
  Result<std::string> data = o->data_dir.empty() ? default_corpus(o->out_dir, world) : Result<std::string>(o->data_dir);
  if (!data.ok()) return fail(data.status());
  o->data_dir = data.value();
  Result<TrainReport> r = run_training(*o, world);
  if (!r.ok()) return fail(r.status());
  if (job->root())
    std::printf("trained to step %lld (%lld steps here): loss %.4f, validation loss %.4f, %.0f tokens/s; checkpoint %s\n",
                static_cast<long long>(r->final_step), static_cast<long long>(r->steps_done), r->last_loss, r->val_loss,
                r->tokens_per_second, r->checkpoint.c_str());
  return kExitOk;
}

}  // namespace

Command add_train_command(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  TrainOptions& o = a->options;
  o.out_dir = "out/train";
  CLI::App* cmd = app.add_subcommand("train", "train a model on any layout (run under mpirun)");
  cmd->add_option("--model", a->model, "Hugging Face style config.json")->required()->check(CLI::ExistingFile);
  cmd->add_option("--data", o.data_dir, "a prepared corpus (default: Debian's fortunes, prepared into OUT/data)");
  cmd->add_option("--out", o.out_dir, "output directory: metrics.jsonl, checkpoints/");
  cmd->add_option("--seq", o.seq, "tokens per sequence (S)")->check(positive());
  cmd->add_option("--batch", o.batch, "sequences per optimizer step (global)")->check(positive());
  cmd->add_option("--micro-batch", o.micro_batch, "sequences per forward per data-parallel rank (default: all)")
      ->check(non_negative());
  cmd->add_option("--steps", o.steps, "optimizer steps (the learning-rate schedule spans them)")->check(positive());
  cmd->add_option("--stop-after", o.stop_after, "stop with a checkpoint after this step (resume later)")
      ->check(non_negative());
  cmd->add_option("--lr", o.optimizer.lr, "peak learning rate");
  cmd->add_option("--min-lr", o.optimizer.min_lr, "learning rate at the end of the cosine decay");
  cmd->add_option("--warmup", o.optimizer.warmup_steps, "linear warmup steps");
  cmd->add_option("--weight-decay", o.optimizer.weight_decay, "AdamW decoupled weight decay (not on norms)");
  cmd->add_option("--grad-clip", o.optimizer.grad_clip, "clip the global gradient norm to this (0: off)");
  cmd->add_option("--seed", o.seed, "seed of the weights and the data order");
  cmd->add_option("--eval-every", o.eval_every, "validation loss every this many steps")->check(non_negative());
  cmd->add_option("--eval-batches", o.eval_batches, "validation batches")->check(non_negative());
  cmd->add_option("--checkpoint-every", o.checkpoint_every, "checkpoint every this many steps (0: at the end)")
      ->check(non_negative());
  cmd->add_option("--keep-checkpoints", o.keep_checkpoints, "complete checkpoints kept")->check(positive());
  cmd->add_option("--print-every", o.print_every, "with --progress lines: a progress line this often")
      ->check(non_negative());
  cmd->add_option("--progress", a->progress,
                  "auto (a bar when stdout, or mpirun's, is a terminal; lines otherwise), bar, lines or none")
      ->transform(choice<Progress>({{"auto", Progress::kAuto}, {"bar", Progress::kBar}, {"lines", Progress::kLines},
                                    {"none", Progress::kNone}}));
  cmd->add_flag("--resume", o.resume, "continue from the newest complete checkpoint in OUT");
  cmd->add_flag("--bf16", a->bf16,
                "store weights and activations in bf16 (f32 master weights); every layout; the default with "
                "--device cuda");
  cmd->add_flag("--f32", a->f32, "store weights and activations in f32 (the default on the CPU)");
  cmd->add_option("--init-from", o.init_from, "start from a Hugging Face directory (config.json + model.safetensors)");
  add_device_option(cmd, a->device, "each rank: GPU local rank mod GPUs; docs/GPU.md");
  add_layout_flags(cmd, a->layout);
  return {cmd, [a] { return run_train_command(*a); }};
}

}  // namespace foldpar::cli
