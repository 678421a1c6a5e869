// The global slices of sharded parameters: over all ranks of an axis the counted slices
// cover every element of every global tensor exactly once, and each local element holds
// the global value its slice says (the map checkpoints reshard with).
#include <gtest/gtest.h>

#include <map>

#include "parallel/sharded_weights.h"

namespace foldpar {
namespace {

LlamaConfig config(bool tied) {
  LlamaConfig c;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.intermediate_size = 24;
  c.vocab_size = 12;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 64;
  c.tie_word_embeddings = tied;
  return c;
}

float local_at(const ParamRef& p, const GlobalSlice& s, int64_t r, int64_t c) {
  const int64_t i = s.transposed ? (c - s.col0) * s.rows + (r - s.row0) : (r - s.row0) * s.cols + (c - s.col0);
  return p.param.data<float>()[s.offset + i];
}

void check_cover(bool tied, int D) {
  const LlamaConfig c = config(tied);
  LlamaWeights global = LlamaWeights::allocate(c, DType::kF32, MemCategory::kWorkspace);
  init_weights(InitOptions{.seed = 3, .std = 1.0, .norm_jitter = 0.5}, global);
  std::map<std::string, Tensor> by_name;
  global.for_each([&](const std::string& n, Tensor& t) { by_name[n] = t; });
  std::map<std::string, std::vector<int>> hits;
  for (const auto& [n, t] : by_name) hits[n].assign(static_cast<size_t>(t.numel()), 0);
  const ShardDims dims = shard_dims(c, D);
  for (int r = 0; r < D; ++r) {
    ShardedWeights w = ShardedWeights::allocate(c, dims, r, DType::kF32, MemCategory::kWorkspace);
    ShardedWeights g = ShardedWeights::allocate(c, dims, r, DType::kF32, MemCategory::kWorkspace);
    shard_from_global(global, w);
    for (const ParamRef& p : sharded_param_refs(w, g, /*count_replicated=*/r == 0)) {
      int64_t covered = 0;
      for (const GlobalSlice& s : p.slices) {
        ASSERT_TRUE(by_name.count(s.tensor)) << s.tensor;
        const Tensor& gt = by_name[s.tensor];
        const int64_t cols = gt.dim(-1);
        for (int64_t i = s.row0; i < s.row0 + s.rows; ++i)
          for (int64_t j = s.col0; j < s.col0 + s.cols; ++j) {
            EXPECT_EQ(local_at(p, s, i, j), gt.data<float>()[i * cols + j]) << p.name << " " << s.tensor;
            if (p.counted) ++hits[s.tensor][static_cast<size_t>(i * cols + j)];
          }
        covered += s.rows * s.cols;
      }
      EXPECT_EQ(covered, p.param.numel()) << p.name << ": slices must cover the local tensor exactly";
    }
  }
  for (const auto& [n, h] : hits)
    for (size_t i = 0; i < h.size(); ++i) ASSERT_EQ(h[i], 1) << n << "[" << i << "] counted " << h[i] << " times";
}

TEST(ParamRefs, ShardedSlicesCoverTheGlobalTensorsOnce) {
  for (int D : {1, 2}) {
    check_cover(false, D);
    check_cover(true, D);
  }
}

TEST(ParamRefs, ReplicatedWeightsAreWholeTensors) {
  const LlamaConfig c = config(true);
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kWorkspace);
  LlamaWeights g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kWorkspace);
  int n = 0;
  for (const ParamRef& p : replicated_param_refs(w, g, true)) {
    ASSERT_EQ(p.slices.size(), 1u);
    EXPECT_EQ(p.slices[0].rows * p.slices[0].cols, p.param.numel());
    EXPECT_EQ(p.decay, !p.name.ends_with("norm.weight"));
    ++n;
  }
  EXPECT_EQ(n, 1 + 2 * 9 + 1);  // tied: no lm_head
}

}  // namespace
}  // namespace foldpar
