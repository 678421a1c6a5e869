// `foldpar export`: a checkpoint (any layout) read as one rank's full model and written as a
// Hugging Face directory. --checkpoint takes a step directory or a training directory (its
// newest complete checkpoint), as generate does (checkpoint/checkpoint.h resolve_checkpoint).
#include <cstdio>
#include <memory>

#include "commands.h"
#include "parallel/sharded_weights.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_directory.h"

namespace foldpar::cli {
namespace {

struct ExportArgs {
  std::string checkpoint, out;
};

int run_export_command(const ExportArgs& a) {
  Result<std::string> dir = resolve_checkpoint(a.checkpoint);
  if (!dir.ok()) return fail(dir.status());
  Result<CheckpointState> st = read_checkpoint_state(*dir);
  if (!st.ok()) return fail(st.status());
  LlamaWeights w = LlamaWeights::allocate(st->config, DType::kF32, MemCategory::kParameters);
  LlamaWeights g = LlamaWeights::allocate(st->config, DType::kF32, MemCategory::kGradients);
  std::vector<ParamRef> refs = replicated_param_refs(w, g, true);
  if (Status s = load_checkpoint(*dir, st->config, refs, nullptr, nullptr); !s.ok()) return fail(s);
  if (Status s = write_hf_directory(a.out, st->config, w); !s.ok()) return fail(s);
  std::printf("exported step %lld of %s to %s\n", static_cast<long long>(st->step), dir->c_str(), a.out.c_str());
  return kExitOk;
}

}  // namespace

Command add_export_command(CLI::App& app) {
  auto a = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand("export", "write a checkpoint as a Hugging Face directory");
  cmd->add_option("--checkpoint", a->checkpoint, "a checkpoint (step-N), or a training directory: its newest")
      ->required();
  cmd->add_option("-o,--out", a->out, "output directory")->required();
  return {cmd, [a] { return run_export_command(*a); }};
}

}  // namespace foldpar::cli
