// Hugging Face directories (config.json + model.safetensors with Llama tensor names): what
// `foldpar export` writes and `foldpar import`, `train --init-from` and `generate --hf` read.
// Reading fills any layout's ParamRef slices from the full tensors (slice_fill.h), so a
// directory loads under every layout and rank count. Neither function is collective.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "model/llama_config.h"
#include "model/llama_weights.h"
#include "parallel/param_ref.h"

namespace foldpar {

// Fills every slice of `params` from the directory `dir` (F32, F64 or BF16 tensors);
// invalid_argument when its config.json does not describe `config`, kCorrupt when a slice is
// not covered.
Status load_hf_weights(const std::string& dir, const LlamaConfig& config, std::vector<ParamRef>& params);
// Writes full (single-rank) weights as such a directory (atomic files); the caller runs it on
// one rank.
Status write_hf_directory(const std::string& dir, const LlamaConfig& config, const LlamaWeights& weights);

}  // namespace foldpar
