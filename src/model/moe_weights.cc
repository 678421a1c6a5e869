// Allocation and naming of the MoE tensors of a sparse layer.
#include "model/moe_weights.h"

#include <fmt/format.h>

namespace foldpar {
namespace {

ExpertWeights allocate_expert(int64_t h, int64_t f, DType dtype, MemCategory category) {
  return ExpertWeights{Tensor::empty({f, h}, dtype, category), Tensor::empty({f, h}, dtype, category),
                       Tensor::empty({h, f}, dtype, category)};
}

}  // namespace

MoeLayerWeights allocate_moe_layer(const LlamaConfig& c, DType dtype, MemCategory category, int64_t sparse_index) {
  return allocate_moe_layer(c, dtype, category, sparse_index, c.moe.num_experts, c.moe.moe_intermediate_size);
}

MoeLayerWeights allocate_moe_layer(const LlamaConfig& c, DType dtype, MemCategory category, int64_t sparse_index,
                                   int64_t experts, int64_t expert_rows) {
  const MoeConfig& m = c.moe;
  const int64_t h = c.hidden_size;
  MoeLayerWeights w;
  w.router = Tensor::empty({m.num_experts, h}, dtype, category);
  if (experts > 0) {
    w.expert_block = Tensor::empty({experts * 3 * expert_rows, h}, dtype, category);
    for (int64_t e = 0; e < experts; ++e) w.experts.push_back(expert_in_block(w.expert_block, e, expert_rows));
  }
  if (m.shared_expert_intermediate_size > 0) {
    w.shared = allocate_expert(h, m.shared_expert_intermediate_size, dtype, category);
    w.shared_gate = Tensor::empty({1, h}, dtype, category);
  }
  w.sparse_index = sparse_index;
  return w;
}

ExpertWeights expert_in_block(const Tensor& block, int64_t j, int64_t f) {
  const int64_t h = block.dim(1), r0 = j * 3 * f;
  return ExpertWeights{block.narrow(r0, r0 + f), block.narrow(r0 + f, r0 + 2 * f),
                       block.narrow(r0 + 2 * f, r0 + 3 * f).reshape({h, f})};
}

bool experts_are_block_views(const MoeLayerWeights& w) {
  if (!w.expert_block.defined() || w.experts.empty()) return false;
  const int64_t n = static_cast<int64_t>(w.experts.size());
  if (w.expert_block.dim(0) % (3 * n) != 0) return false;
  const int64_t f = w.expert_block.dim(0) / (3 * n);
  const auto same = [&](const Tensor& a, const Tensor& b) {
    return a.defined() && a.shares_storage_with(b) && a.raw_data() == b.raw_data() && a.shape() == b.shape() &&
           a.dtype() == b.dtype();
  };
  for (int64_t j = 0; j < n; ++j) {
    const ExpertWeights v = expert_in_block(w.expert_block, j, f);
    const ExpertWeights& e = w.experts[static_cast<size_t>(j)];
    if (!same(e.w_gate, v.w_gate) || !same(e.w_up, v.w_up) || !same(e.w_down, v.w_down)) return false;
  }
  return true;
}

bool is_expert_down_projection(const std::string& name) {
  return name.find(".experts.") != std::string::npos &&
         (name.ends_with(".w2.weight") || name.ends_with(".down_proj.weight"));
}

void for_each_moe_tensor(const std::string& p, MoeFamily family, MoeLayerWeights& w,
                         const std::function<void(const std::string&, Tensor&)>& fn) {
  if (family == MoeFamily::kMixtral) {
    fn(p + "block_sparse_moe.gate.weight", w.router);
    for (size_t e = 0; e < w.experts.size(); ++e) {
      const std::string q = fmt::format("{}block_sparse_moe.experts.{}.", p, e);
      fn(q + "w1.weight", w.experts[e].w_gate);
      fn(q + "w2.weight", w.experts[e].w_down);
      fn(q + "w3.weight", w.experts[e].w_up);
    }
    return;
  }
  fn(p + "mlp.gate.weight", w.router);
  for (size_t e = 0; e < w.experts.size(); ++e) {
    const std::string q = fmt::format("{}mlp.experts.{}.", p, e);
    fn(q + "gate_proj.weight", w.experts[e].w_gate);
    fn(q + "up_proj.weight", w.experts[e].w_up);
    fn(q + "down_proj.weight", w.experts[e].w_down);
  }
  if (w.shared_gate.defined()) {
    fn(p + "mlp.shared_expert.gate_proj.weight", w.shared.w_gate);
    fn(p + "mlp.shared_expert.up_proj.weight", w.shared.w_up);
    fn(p + "mlp.shared_expert.down_proj.weight", w.shared.w_down);
    fn(p + "mlp.shared_expert_gate.weight", w.shared_gate);
  }
}

}  // namespace foldpar
