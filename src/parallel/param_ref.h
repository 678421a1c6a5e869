// ParamRef: one parameter tensor a rank holds, with its gradient, as the optimizer and the
// checkpoints see it, and where its elements live in the global (Hugging Face) tensors, so
// that a checkpoint written under one layout loads into any other.
#pragma once

#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace foldpar {

// A block of a global tensor held in a local one. Global tensors are viewed as 2-D
// [numel / last extent, last extent] (a norm gain [h] is [1, h]).
struct GlobalSlice {
  std::string tensor;         // Hugging Face name, e.g. "model.layers.0.self_attn.o_proj.weight"
  int64_t row0 = 0, rows = 0;
  int64_t col0 = 0, cols = 0;
  bool transposed = false;    // stored locally as [cols, rows] (TSP's Wo^T, Wdown^T)
  int64_t offset = 0;         // element offset of the block inside the local tensor
};

struct ParamRef {
  std::string name;           // unique within the layout, e.g. "layers.3.attn"
  Tensor param;               // f32
  Tensor grad;                // same shape
  bool decay = true;          // AdamW weight decay applies (not to norm gains)
  // This rank speaks for the tensor in global sums and in checkpoints. Copies replicated
  // over an axis are counted on one rank of it only, so every global element counts once.
  bool counted = true;
  std::vector<GlobalSlice> slices;  // together they cover the local tensor exactly
  // A routed expert's tensor (or slice): where the expert groups span dp replicas (Layout::ep)
  // only some replicas hold it, so its gradient sums over those (ShardedModel::expert_data_axis)
  // and clipping counts it once per expert-data replica group.
  bool routed_expert = false;
};

}  // namespace foldpar
