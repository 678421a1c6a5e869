// `foldpar prepare-data`: text files into token files (src/data/corpus.h).
#include <cstdio>
#include <memory>

#include "commands.h"
#include "data/corpus.h"

namespace foldpar::cli {
namespace {

int run_prepare_command(const PrepareOptions& o) {
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
  auto o = std::make_shared<PrepareOptions>();
  CLI::App* cmd = app.add_subcommand("prepare-data", "turn text files into token files (train.tokens, val.tokens)");
  cmd->add_option("--input", o->inputs, "text files or directories (default: Debian's fortunes)")->check(CLI::ExistingPath);
  cmd->add_option("--out", o->out_dir, "output directory")->required();
  cmd->add_option("--tokenizer", o->tokenizer, "a SentencePiece model (default: bytes)");
  return {cmd, [o] { return run_prepare_command(*o); }};
}

}  // namespace foldpar::cli
