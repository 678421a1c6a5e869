// Loading parameters from blocks of the global (Hugging Face) tensors, shared by the two
// stored formats of this layer: foldpar checkpoints (checkpoint.h) and Hugging Face
// directories (hf_directory.h). Each rank fills exactly its ParamRef slices from whatever
// stored blocks intersect them, which is what makes loading reshard. Internal to the
// checkpoint layer: nothing outside src/checkpoint/ includes this header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "io/safetensors.h"
#include "model/llama_config.h"
#include "parallel/param_ref.h"
#include "tensor/tensor.h"

namespace foldpar {

// A block [row0, row0 + rows) x [col0, col0 + cols) of a global tensor in its [rows, cols]
// orientation.
struct GlobalBox {
  int64_t row0, rows, col0, cols;
};

// One stored block: entry `name` of files[file], covering `box`.
struct StoredBlock {
  size_t file;
  std::string name;
  GlobalBox box;
};
// (kind, global tensor name) -> the stored blocks of it. Kinds: "param", "adam_m", "adam_v".
using BlockIndex = std::map<std::pair<std::string, std::string>, std::vector<StoredBlock>>;

// Fills every slice of `targets[i]` (the tensors of params[i] for this kind, f32, laid out as
// params[i].param) from the intersecting blocks of `index`; kCorrupt, naming `what`, the
// tensor and the coverage, when a slice is not fully covered.
Status fill_slices(const std::string& what, const char* kind, const std::vector<ParamRef>& params,
                   const std::vector<Tensor*>& targets, std::vector<SafetensorsFile>& files, BlockIndex& index);

// Pointers to each ParamRef's parameter tensor, or to each tensor of a list (the moments).
std::vector<Tensor*> tensors_of(std::vector<ParamRef>& params);
std::vector<Tensor*> tensors_of(std::vector<Tensor>& list);

// invalid_argument naming both configs when `stored` describes a different model than
// `ours` (sizes, heads, layers, vocabulary, tying; not the training hyperparameters).
Status same_config(const LlamaConfig& stored, const LlamaConfig& ours);

}  // namespace foldpar
