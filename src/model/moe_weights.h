// Allocation and Hugging Face names of a sparse layer's MoE tensors (llama_weights.cc calls
// these for the layers MoeConfig::is_sparse_layer names). Mixtral:
//   block_sparse_moe.gate.weight [E, h], block_sparse_moe.experts.j.{w1,w3,w2}.weight;
// Qwen2-MoE / Qwen3-MoE:
//   mlp.gate.weight [E, h], mlp.experts.j.{gate,up,down}_proj.weight,
//   mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight [1, h].
#pragma once

#include <functional>
#include <string>

#include "model/llama_weights.h"

namespace foldpar {

MoeLayerWeights allocate_moe_layer(const LlamaConfig& config, DType dtype, MemCategory category,
                                   int64_t sparse_index);
// A sharded layer's: the router and shared expert whole, `experts` routed experts of width
// `expert_rows` (a slice of f_e when experts are split over ranks).
MoeLayerWeights allocate_moe_layer(const LlamaConfig& config, DType dtype, MemCategory category,
                                   int64_t sparse_index, int64_t experts, int64_t expert_rows);

// Whether `name` is a routed expert's down projection ([h, f_e]: experts.j.w2 / down_proj),
// whose f_e runs along its columns (gate and up along their rows).
bool is_expert_down_projection(const std::string& name);

// Visits the layer's MoE tensors in state-dict order; `prefix` is "model.layers.N.".
void for_each_moe_tensor(const std::string& prefix, MoeFamily family, MoeLayerWeights& w,
                         const std::function<void(const std::string& name, Tensor& t)>& fn);

}  // namespace foldpar
