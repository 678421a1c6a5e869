// `foldpar generate`: weights from a checkpoint written under any layout (or a Hugging Face
// directory), a decoder for the generation layout (tsp=N or tp=N), prompts, and the
// generation loop of infer/generator.h. Options in, report out; printing is the caller's.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "infer/generator.h"
#include "model/llama_config.h"
#include "parallel/sharded_model.h"

namespace foldpar {

struct GenerateOptions {
  std::string checkpoint;          // a step-N directory, or a directory holding them (the newest
                                   // complete one; also DIR/checkpoints, a training directory)
  std::string hf_dir;              // or a Hugging Face directory (config.json + model.safetensors)
  // tsp=N or tp=N with the knobs prefill reads (split, overlap, head buckets); none:
  // tsp=<world size>.
  std::optional<Layout> layout;
  std::string tokenizer;          // "" (bytes; --hf: its tokenizer.json when present), bytes, a SentencePiece model or a tokenizer.json (data/tokenizer.h)
  std::vector<std::string> prompts;
  GenerationOptions generation;
  // Where the decoder runs (as TrainOptions::backend and ::axis_comm): borrowed, null for
  // the fast CPU backend and the mesh's MPI communicators. Host code reads the logits after
  // each step, so a GPU backend must finish each op before returning.
  Backend* backend = nullptr;
  AxisCommFactory axis_comm;
};

struct GenerateResult {
  GenerationReport report;
  std::string layout;   // the decoder's
  std::string source;   // the checkpoint directory or Hugging Face directory read
  LlamaConfig config;
};

// Collective over `world` (every rank passes the same options). invalid_argument /
// not_found / corrupt naming the file or value for every user mistake.
Result<GenerateResult> run_generate(const GenerateOptions& options, Communicator& world,
                                    const GenerationCallbacks& callbacks = {});

// The prompts of a file: one per non-empty line; a file named *.jsonl holds one JSON string,
// or one object with a "prompt" string, per line (for prompts with newlines).
Result<std::vector<std::string>> read_prompt_file(const std::string& path);

}  // namespace foldpar
