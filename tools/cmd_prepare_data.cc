// `foldpar prepare-data`: text files, or token streams others wrote (.bin, .npy), into token
// files (src/data/corpus.h).
#include <cstdio>
#include <memory>

#include "commands.h"
#include "data/corpus.h"
#include "model/llama_config.h"

namespace foldpar::cli {
namespace {

struct PrepareArgs {
  PrepareOptions options;
  std::string model;  // the config whose vocabulary token streams are checked against
};

int run_prepare_command(PrepareArgs a) {
  PrepareOptions& o = a.options;
  if (!a.model.empty()) {
    Result<LlamaConfig> config = LlamaConfig::load(a.model);
    if (!config.ok()) return fail(config.status());
    o.vocab_size = static_cast<uint32_t>(config->vocab_size);
  }
  Result<PrepareReport> r = prepare_corpus(o);
  if (!r.ok()) return fail(r.status());
  std::printf("%lld files, %lld documents, %lld bytes -> %lld training and %lld validation tokens (%s, vocabulary %u) in %s\n",
              static_cast<long long>(r->files), static_cast<long long>(r->documents), static_cast<long long>(r->bytes),
              static_cast<long long>(r->train_tokens), static_cast<long long>(r->val_tokens), r->tokenizer.c_str(),
              r->vocab_size, o.out_dir.c_str());
  return kExitOk;
}

}  // namespace

Command add_prepare_data_command(CLI::App& app) {
  auto a = std::make_shared<PrepareArgs>();
  PrepareOptions& o = a->options;
  CLI::App* cmd = app.add_subcommand("prepare-data", "turn text files into token files (train.tokens, val.tokens)");
  cmd->add_option("--input", o.inputs, "text files or directories (default: Debian's fortunes)")->check(CLI::ExistingPath);
  cmd->add_option("--out", o.out_dir, "output directory")->required();
  cmd->add_option("--tokenizer", o.tokenizer, "a SentencePiece model (default: bytes)");
  cmd->add_option("--input-format", o.input_format,
                  "text, or token ids others wrote: bin-u16 / bin-u32 (raw little-endian), npy (NumPy '<u2', '<u4', '<i4', '<i8', '<u8')");
  cmd->add_option("--separator-token", o.separator_token, "token streams: the id that ends each document (kept)");
  cmd->add_option("--model", a->model, "token streams: the model config whose vocab_size every id must be below")
      ->check(CLI::ExistingFile);
  return {cmd, [a] { return run_prepare_command(*a); }};
}

}  // namespace foldpar::cli
