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

// Expert j's views into a block of experts [n * 3 f, h] (MoeLayerWeights::expert_block): its
// gate and up projections [f, h], then its down projection [h, f], from row 3 f j.
ExpertWeights expert_in_block(const Tensor& block, int64_t j, int64_t f);
// Whether w.experts are exactly expert_in_block(w.expert_block, j, f) (same addresses and
// shapes): what a consumer checks before it takes the block for the experts.
bool experts_are_block_views(const MoeLayerWeights& w);

// Whether `name` is a routed expert's down projection ([h, f_e]: experts.j.w2 / down_proj),
// whose f_e runs along its columns (gate and up along their rows).
bool is_expert_down_projection(const std::string& name);

// Visits the layer's MoE tensors in state-dict order; `prefix` is "model.layers.N.".
void for_each_moe_tensor(const std::string& prefix, MoeFamily family, MoeLayerWeights& w,
                         const std::function<void(const std::string& name, Tensor& t)>& fn);

}  // namespace foldpar
