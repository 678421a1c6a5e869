// `foldpar export`: a checkpoint (any layout) or a Hugging Face directory read as one rank's
// full model and written as a Hugging Face directory (--format hf) or as one GGUF file for
// llama.cpp (--format gguf; checkpoint/gguf_export.h). --checkpoint takes a step directory or
// a training directory (its newest complete checkpoint), as generate does.
#include <cstdio>
#include <filesystem>
#include <memory>

#include "commands.h"
#include "parallel/sharded_weights.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/gguf_export.h"
#include "checkpoint/hf_directory.h"
#include "data/tokenizer.h"
#include "data/tokenizer_vocab.h"

namespace foldpar::cli {
namespace {

struct ExportArgs {
  std::string checkpoint, hf, out;
  std::string format = "hf", dtype = "f32", tokenizer;
};

struct LoadedModel {
  LlamaConfig config;
  LlamaWeights weights;
  std::string what;  // "step N of DIR" or the Hugging Face directory
};

Result<LoadedModel> load_model(const ExportArgs& a) {
  if (a.checkpoint.empty() == a.hf.empty()) return invalid_argument("give one of --checkpoint and --hf");
  LoadedModel m;
  int64_t step = 0;
  std::string dir = a.hf;
  if (!a.checkpoint.empty()) {
    FP_ASSIGN_OR_RETURN(dir, resolve_checkpoint(a.checkpoint));
    FP_ASSIGN_OR_RETURN(CheckpointState st, read_checkpoint_state(dir));
    m.config = st.config;
    step = st.step;
  } else {
    FP_ASSIGN_OR_RETURN(m.config, LlamaConfig::load((std::filesystem::path(dir) / "config.json").string()));
  }
  m.weights = LlamaWeights::allocate(m.config, DType::kF32, MemCategory::kParameters);
  LlamaWeights g = LlamaWeights::allocate(m.config, DType::kF32, MemCategory::kGradients);
  std::vector<ParamRef> refs = replicated_param_refs(m.weights, g, true);
  if (!a.checkpoint.empty()) {
    FP_RETURN_IF_ERROR(load_checkpoint(dir, m.config, refs, nullptr, nullptr));
    m.what = fmt::format("step {} of {}", step, dir);
  } else {
    FP_RETURN_IF_ERROR(load_hf_weights(dir, m.config, refs));
    m.what = dir;
  }
  return m;
}

// A byte-level BPE tokenizer.json as llama.cpp's "gpt2" vocabulary: added special tokens are
// control tokens, other added ones user-defined, ids up to the model's vocab_size that the
// file does not name unused. bos/eos from tokenizer_config.json; no BOS is added, as foldpar
// adds none when it prepares data or generates.
Result<GgufVocab> byte_level_bpe_gguf_vocab(const std::string& path, const Tokenizer& tok, int64_t vocab_size) {
  FP_ASSIGN_OR_RETURN(ByteLevelBpeVocab bpe, read_byte_level_bpe_vocab(path));
  if (static_cast<int64_t>(bpe.tokens.size()) > vocab_size)
    return invalid_argument("{} has {} tokens, more than the model's vocabulary ({})", path, bpe.tokens.size(), vocab_size);
  GgufVocab v;
  v.model = "gpt2";
  FP_ASSIGN_OR_RETURN(v.pre, llama_cpp_pre_tokenizer(bpe.split_regex));
  for (int64_t id = 0; id < vocab_size; ++id) {
    using Kind = ByteLevelBpeVocab::Kind;
    const Kind k = id < static_cast<int64_t>(bpe.tokens.size()) ? bpe.kinds[id] : Kind::kMissing;
    v.tokens.push_back(k == Kind::kMissing ? fmt::format("<|unused_{}|>", id) : bpe.tokens[id]);
    v.token_types.push_back(k == Kind::kNormal ? 1 : k == Kind::kSpecial ? 3 : k == Kind::kAdded ? 4 : 5);
  }
  v.merges = std::move(bpe.merges);
  v.bos_id = tok.bos_id().value_or(-1);
  v.eos_id = tok.eos_id().value_or(-1);
  return v;
}

// The vocabulary llama.cpp gets: foldpar's byte tokenizer, or a byte-level BPE tokenizer.json.
Result<GgufVocab> gguf_vocab(const ExportArgs& a, const LlamaConfig& config) {
  FP_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, make_tokenizer(default_tokenizer_spec(a.tokenizer, a.hf)));
  const std::string what = tok->describe();
  if (what == "bytes") return byte_tokenizer_vocab(config.vocab_size);
  if (what.starts_with("hf:")) return byte_level_bpe_gguf_vocab(what.substr(3), *tok, config.vocab_size);
  return invalid_argument("GGUF export of the tokenizer {} is not implemented (bytes or a byte-level BPE tokenizer.json)",
                          what);
}

Status export_model(const ExportArgs& a) {
  if (a.format != "hf" && a.format != "gguf") return invalid_argument("unknown --format '{}' (hf or gguf)", a.format);
  FP_ASSIGN_OR_RETURN(GgufDType dtype, gguf_dtype_from_name(a.dtype));
  if (a.format == "hf" && dtype != GgufDType::kF32) return invalid_argument("--dtype {} is for --format gguf", a.dtype);
  FP_ASSIGN_OR_RETURN(LoadedModel m, load_model(a));
  if (a.format == "hf") {
    FP_RETURN_IF_ERROR(write_hf_directory(a.out, m.config, m.weights));
  } else {
    FP_ASSIGN_OR_RETURN(GgufVocab vocab, gguf_vocab(a, m.config));
    FP_RETURN_IF_ERROR(write_gguf_model(a.out, m.config, m.weights, vocab, dtype));
  }
  std::printf("exported %s to %s (%s)\n", m.what.c_str(), a.out.c_str(), a.format.c_str());
  return Status::ok_status();
}

}  // namespace

Command add_export_command(CLI::App& app) {
  auto a = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand("export", "write a checkpoint as a Hugging Face directory or a GGUF file (llama.cpp)");
  cmd->add_option("--checkpoint", a->checkpoint, "a checkpoint (step-N), or a training directory: its newest");
  cmd->add_option("--hf", a->hf, "or: a Hugging Face directory (config.json + model.safetensors)");
  cmd->add_option("-o,--out", a->out, "output directory (hf), or file (gguf)")->required();
  cmd->add_option("--format", a->format, "hf (config.json + model.safetensors) or gguf (one file for llama.cpp)");
  cmd->add_option("--dtype", a->dtype, "gguf matrices: f32, f16 or bf16 (norm gains stay f32)");
  cmd->add_option("--tokenizer", a->tokenizer, "gguf: bytes (the default; --hf: its tokenizer.json) or a byte-level BPE tokenizer.json");
  return {cmd, [a] {
            if (Status s = export_model(*a); !s.ok()) return fail(s);
            return kExitOk;
          }};
}

}  // namespace foldpar::cli
