// `foldpar import`: a Hugging Face directory becomes step 0 of a training directory; `train
// --resume --out OUT` then starts from it under any layout (fresh optimizer state).
#include <cstdio>
#include <filesystem>
#include <memory>

#include "commands.h"
#include "job.h"
#include "parallel/sharded_weights.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_directory.h"

namespace foldpar::cli {
namespace {

struct ImportArgs {
  std::string hf, out;
};

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
  Result<Job> job = start_job();
  if (!job.ok()) return fail(job.status());
  CheckpointState st{0, 0, 0, "imported", *config};
  Result<std::string> dir = save_checkpoint((std::filesystem::path(a.out) / "checkpoints").string(), st,
                                            CheckpointWrite{&refs, &m, &v, true, 2}, job->world());
  if (!dir.ok()) return fail(dir.status());
  std::printf("imported %s as %s\n", a.hf.c_str(), dir->c_str());
  return kExitOk;
}

}  // namespace

Command add_import_command(CLI::App& app) {
  auto a = std::make_shared<ImportArgs>();
  CLI::App* cmd = app.add_subcommand("import", "make a Hugging Face directory step 0 of a training directory");
  cmd->add_option("--hf", a->hf, "directory with config.json and model.safetensors")->required()->check(CLI::ExistingDirectory);
  cmd->add_option("-o,--out", a->out, "training directory (train --resume --out DIR continues)")->required();
  return {cmd, [a] { return run_import_command(*a); }};
}

}  // namespace foldpar::cli
