// foldpar generate: resolve the weights, build the decoder, load its slices, generate.
#include "app/generate.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_directory.h"
#include "comm/mesh.h"
#include "data/tokenizer.h"
#include "parallel/failed_ranks.h"
#include "parallel/make_layout.h"

namespace foldpar {
namespace fs = std::filesystem;
namespace {

struct Weights {
  LlamaConfig config;
  std::string source;
  bool hf = false;
};

Result<Weights> locate_weights(const GenerateOptions& o) {
  if (o.checkpoint.empty() == o.hf_dir.empty())
    return invalid_argument("give exactly one of --checkpoint and --hf");
  Weights w;
  if (!o.checkpoint.empty()) {
    FP_ASSIGN_OR_RETURN(w.source, resolve_checkpoint(o.checkpoint));
    FP_ASSIGN_OR_RETURN(CheckpointState st, read_checkpoint_state(w.source));
    w.config = st.config;
  } else {
    w.source = o.hf_dir;
    w.hf = true;
    FP_ASSIGN_OR_RETURN(w.config, LlamaConfig::load((fs::path(o.hf_dir) / "config.json").string()));
  }
  // Generation routes dropless: a capacity limit is a training-time regularizer, and a decoded
  // token cannot know the sequence length it would be counted against.
  w.config.moe.capacity_factor = 0.0;
  return w;
}

}  // namespace

Result<std::vector<std::string>> read_prompt_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found("prompt file '{}' cannot be read", path);
  const bool jsonl = path.ends_with(".jsonl");
  std::vector<std::string> prompts;
  int64_t line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (!jsonl) {
      prompts.push_back(line);
      continue;
    }
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_string()) {
      prompts.push_back(j.get<std::string>());
    } else if (j.is_object() && j.contains("prompt") && j["prompt"].is_string()) {
      prompts.push_back(j["prompt"].get<std::string>());
    } else {
      return invalid_argument("{}:{}: expected a JSON string or an object with a \"prompt\" string", path, line_no);
    }
  }
  if (prompts.empty()) return invalid_argument("prompt file '{}' holds no prompt", path);
  return prompts;
}

Result<GenerateResult> run_generate(const GenerateOptions& o, Communicator& world, const GenerationCallbacks& cb) {
  FP_ASSIGN_OR_RETURN(Weights src, locate_weights(o));
  FP_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                      make_tokenizer(default_tokenizer_spec(o.tokenizer, src.hf ? src.source : "")));
  if (static_cast<int64_t>(tokenizer->vocab_size()) > src.config.vocab_size)
    return invalid_argument("tokenizer {} has {} tokens, more than the model's vocabulary ({})", tokenizer->describe(),
                            tokenizer->vocab_size(), src.config.vocab_size);
  const Layout layout = o.layout.value_or(tsp_layout(world.size()));
  FP_RETURN_IF_ERROR(validate_layout(src.config, layout, 0, 0));
  FP_ASSIGN_OR_RETURN(Mesh mesh, Mesh::create(world, layout.mesh(), o.axis_comm));
  FP_ASSIGN_OR_RETURN(std::unique_ptr<ShardedDecoder> decoder, make_sharded_decoder(src.config, mesh, layout));
  std::vector<ParamRef> refs = decoder->parameters();
  // Each rank reads its own slices; a failure on one rank is every rank's (same files).
  Status loaded = src.hf ? load_hf_weights(src.source, src.config, refs)
                         : load_checkpoint(src.source, src.config, refs, nullptr, nullptr);
  // The other ranks report the failing one's error class, so the job's exit code is one.
  const PhaseVerdict v = agree_on_phase(world, loaded);
  if (!loaded.ok()) return loaded;
  if (!v.ok())
    return Status(v.first_code, fmt::format("rank(s) {} could not load the weights from '{}'", fmt::join(v.failed, ", "),
                                            src.source));
  std::unique_ptr<Backend> cpu = o.backend != nullptr ? nullptr : make_cpu_backend();
  Backend& be = o.backend != nullptr ? *o.backend : *cpu;
  FP_ASSIGN_OR_RETURN(GenerationReport report, generate(*decoder, be, *tokenizer, o.prompts, o.generation, world, cb));
  return GenerateResult{std::move(report), decoder->layout(), src.source, src.config};
}

}  // namespace foldpar
