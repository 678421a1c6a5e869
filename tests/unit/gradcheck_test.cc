// Finite-difference checks in fp64 of every op's backward and of the whole model's
// gradient, on the reference backend's f64 path. The model check also proves the
// hand-written backward (model/llama_block.cc) is the exact adjoint of its forward.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "backend/backend.h"
#include "backend/rope_table.h"
#include "core/tolerance.h"
#include "model/llama_model.h"
#include "test_util.h"

namespace foldpar {
namespace {

using testing::expect_gradient;
using testing::random_tensor;

// <r, y> in f64.
double dot(const Tensor& r, const Tensor& y) {
  double s = 0;
  for (int64_t i = 0; i < r.numel(); ++i) s += r.data<double>()[i] * y.data<double>()[i];
  return s;
}

class GradCheck : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be_ = make_reference_backend();
  static Tensor f64(const Shape& s, uint64_t seed, double scale = 1.0) {
    return random_tensor(s, DType::kF64, seed, scale);
  }
  static Tensor empty64(const Shape& s) { return Tensor::empty(s, DType::kF64, MemCategory::kWorkspace); }
};

TEST_F(GradCheck, Matmul) {
  // c = a b^T as the model uses it: dc/da = r b, dc/db = r^T a.
  Tensor a = f64({5, 4}, 1), b = f64({3, 4}, 2), r = f64({5, 3}, 3);
  auto loss = [&] {
    Tensor c = empty64({5, 3});
    be_->matmul(a, false, b, true, c);
    return dot(r, c);
  };
  Tensor da = empty64({5, 4}), db = empty64({3, 4});
  be_->matmul(r, false, b, false, da);
  be_->matmul(r, true, a, false, db);
  expect_gradient("matmul a", a, da, loss);
  expect_gradient("matmul b", b, db, loss);
}

TEST_F(GradCheck, RmsNorm) {
  Tensor x = f64({3, 6}, 4), w = f64({6}, 5), r = f64({3, 6}, 6);
  auto loss = [&] {
    Tensor y = empty64({3, 6}), rstd = empty64({3});
    be_->rmsnorm_forward(x, w, 1e-5, y, rstd);
    return dot(r, y);
  };
  Tensor y = empty64({3, 6}), rstd = empty64({3}), dx = empty64({3, 6});
  Tensor dw = Tensor::zeros({6}, DType::kF64, MemCategory::kWorkspace);
  be_->rmsnorm_forward(x, w, 1e-5, y, rstd);
  be_->rmsnorm_backward(x, w, rstd, r, dx, dw);
  expect_gradient("rmsnorm x", x, dx, loss);
  expect_gradient("rmsnorm w", w, dw, loss);
}

TEST_F(GradCheck, Rope) {
  std::vector<int32_t> pos = {3, 0, 17};
  Tensor table = build_rope_table(*make_reference_backend(), pos, 8, 10000.0, DType::kF64);
  Tensor x = f64({1, 3, 2, 8}, 7), r = f64({1, 3, 2, 8}, 8);
  auto loss = [&] {
    Tensor y = x.clone(MemCategory::kWorkspace);
    be_->rope_forward(table, y);
    return dot(r, y);
  };
  Tensor dx = r.clone(MemCategory::kWorkspace);
  be_->rope_backward(table, dx);
  expect_gradient("rope x", x, dx, loss);
}

TEST_F(GradCheck, AttentionGqaWithZigzagPositions) {
  // Queries are two zigzag chunks of a sequence of 8; keys are the whole sequence.
  Tensor qpos = testing::i32_tensor({4}, {0, 1, 6, 7});
  Tensor kpos = testing::iota_i32(8);
  Tensor q = f64({2, 4, 4, 4}, 9), k = f64({2, 8, 2, 4}, 10), v = f64({2, 8, 2, 4}, 11), r = f64({2, 4, 4, 4}, 12);
  AttentionArgs args{&q, &k, &v, &qpos, &kpos, 0.5};
  auto loss = [&] {
    Tensor out = empty64({2, 4, 4, 4}), lse = empty64({2, 4, 4});
    be_->attention_forward(args, out, lse);
    return dot(r, out);
  };
  Tensor out = empty64({2, 4, 4, 4}), lse = empty64({2, 4, 4});
  be_->attention_forward(args, out, lse);
  Tensor dq = empty64(q.shape()), dk = empty64(k.shape()), dv = empty64(v.shape());
  be_->attention_backward(args, out, lse, r, dq, dk, dv);
  expect_gradient("attention q", q, dq, loss);
  expect_gradient("attention k", k, dk, loss);
  expect_gradient("attention v", v, dv, loss);
}

TEST_F(GradCheck, Swiglu) {
  Tensor g = f64({4, 5}, 13, 2.0), u = f64({4, 5}, 14), r = f64({4, 5}, 15);
  auto loss = [&] {
    Tensor o = empty64({4, 5});
    be_->swiglu_forward(g, u, o);
    return dot(r, o);
  };
  Tensor dg = empty64({4, 5}), du = empty64({4, 5});
  be_->swiglu_backward(g, u, r, dg, du);
  expect_gradient("swiglu gate", g, dg, loss);
  expect_gradient("swiglu up", u, du, loss);
}

TEST_F(GradCheck, Embedding) {
  Tensor table = f64({5, 3}, 16), r = f64({4, 3}, 17);
  Tensor ids = testing::i32_tensor({4}, {1, 4, 1, 0});
  auto loss = [&] {
    Tensor o = Tensor::zeros({4, 3}, DType::kF64, MemCategory::kWorkspace);
    be_->embedding_forward(ids, table, 0, o);
    return dot(r, o);
  };
  Tensor dt = Tensor::zeros({5, 3}, DType::kF64, MemCategory::kWorkspace);
  be_->embedding_backward(ids, r, 0, dt);
  expect_gradient("embedding table", table, dt, loss);
}

TEST_F(GradCheck, CrossEntropy) {
  Tensor logits = f64({4, 7}, 18, 3.0);
  Tensor tg = testing::i32_tensor({4}, {2, -100, 6, 0});
  auto loss = [&] {
    Tensor lse = empty64({4});
    return be_->cross_entropy_forward(logits, tg, -100, lse) / 3.0;
  };
  Tensor lse = empty64({4}), d = empty64({4, 7});
  be_->cross_entropy_forward(logits, tg, -100, lse);
  be_->cross_entropy_backward(logits, tg, lse, 0, -100, 1.0 / 3.0, d);
  expect_gradient("cross entropy logits", logits, d, loss);
}

LlamaConfig tiny_config(bool tied) {
  LlamaConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.num_hidden_layers = 2;
  c.vocab_size = 11;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

Batch tiny_batch() {
  Batch b;
  b.input_ids = testing::i32_tensor({2, 5}, {1, 5, 7, 2, 10, 0, 3, 3, 9, 4});
  b.target_ids = testing::i32_tensor({2, 5}, {5, 7, 2, 10, -100, 3, 3, 9, 4, 8});
  return b;
}

class ModelGradCheck : public ::testing::TestWithParam<std::tuple<bool, Recompute>> {};

TEST_P(ModelGradCheck, EveryParameterOfATinyModel) {
  const auto [tied, recompute] = GetParam();
  const LlamaConfig c = tiny_config(tied);
  ASSERT_TRUE(c.validate().ok());
  auto be = make_reference_backend();
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF64, MemCategory::kParameters);
  // std 0.5 makes every path matter (at 0.02 attention is nearly uniform and the loss flat).
  init_weights(InitOptions{.seed = 3, .std = 0.5, .norm_jitter = 0.3}, w);
  LlamaWeights g = LlamaWeights::allocate(c, DType::kF64, MemCategory::kGradients);
  g.zero();
  const Batch batch = tiny_batch();
  StepOptions opts;
  opts.recompute = recompute;
  Result<StepResult> r = model_forward_backward(c, *be, w, batch, opts, g);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->valid_tokens, 9);
  auto loss = [&] { return model_forward(c, *be, w, batch, {}).value().loss; };
  EXPECT_NEAR(loss(), r->loss, 1e-14);
  std::vector<std::pair<std::string, Tensor>> grads;
  g.for_each([&](const std::string& name, Tensor& t) { grads.emplace_back(name, t); });
  size_t i = 0;
  w.for_each([&](const std::string& name, Tensor& t) {
    ASSERT_EQ(grads[i].first, name);
    expect_gradient(name, t, grads[i].second, loss, 24);
    ++i;
  });
  EXPECT_EQ(i, grads.size());
}

INSTANTIATE_TEST_SUITE_P(TiedAndRecompute, ModelGradCheck,
                         ::testing::Values(std::make_tuple(false, Recompute::kNone),
                                           std::make_tuple(true, Recompute::kNone),
                                           std::make_tuple(false, Recompute::kBlock)));

// The Hugging Face attention variants (issue 21): q/k/v biases (qwen2), q/k/v/o biases
// (llama attention_bias), per-head q/k RMSNorm with head_dim != h / n_h (qwen3, also under
// block recompute), and Llama's mlp_bias (gate/up/down biases). Every parameter, the
// biases and norm gains included, against central differences.
struct AttnVariant {
  const char* name;
  bool qkv_bias, o_bias, qk_norm;
  int64_t head_dim;
  Recompute recompute;
  bool mlp_bias = false;
};

class AttnVariantGradCheck : public ::testing::TestWithParam<AttnVariant> {};

TEST_P(AttnVariantGradCheck, EveryParameterIncludingBiasesAndQkNorms) {
  const AttnVariant v = GetParam();
  LlamaConfig c = tiny_config(false);
  c.qkv_bias = v.qkv_bias;
  c.o_bias = v.o_bias;
  c.qk_norm = v.qk_norm;
  c.explicit_head_dim = v.head_dim;
  c.mlp_bias = v.mlp_bias;
  ASSERT_TRUE(c.validate().ok()) << c.validate().to_string();
  auto be = make_reference_backend();
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF64, MemCategory::kParameters);
  init_weights(InitOptions{.seed = 4, .std = 0.5, .norm_jitter = 0.3}, w);
  LlamaWeights g = LlamaWeights::allocate(c, DType::kF64, MemCategory::kGradients);
  g.zero();
  const Batch batch = tiny_batch();
  StepOptions opts;
  opts.recompute = v.recompute;
  Result<StepResult> r = model_forward_backward(c, *be, w, batch, opts, g);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  auto loss = [&] { return model_forward(c, *be, w, batch, {}).value().loss; };
  EXPECT_NEAR(loss(), r->loss, 1e-14);
  std::vector<std::pair<std::string, Tensor>> grads;
  g.for_each([&](const std::string& name, Tensor& t) { grads.emplace_back(name, t); });
  size_t i = 0;
  int variant_tensors = 0;
  w.for_each([&](const std::string& name, Tensor& t) {
    ASSERT_EQ(grads[i].first, name);
    if (name.ends_with(".bias") || name.ends_with("q_norm.weight") || name.ends_with("k_norm.weight")) {
      ++variant_tensors;
      double largest = 0;
      for (int64_t k = 0; k < grads[i].second.numel(); ++k)
        largest = std::max(largest, std::abs(grads[i].second.data<double>()[k]));
      EXPECT_GT(largest, 1e-6) << name << ": a zero gradient checks nothing";
    }
    expect_gradient(name, t, grads[i].second, loss, 24);
    ++i;
  });
  EXPECT_EQ(variant_tensors, c.num_hidden_layers * ((v.qkv_bias ? 3 : 0) + (v.o_bias ? 1 : 0) + (v.qk_norm ? 2 : 0) +
                                                    (v.mlp_bias ? 3 : 0)));
  EXPECT_EQ(static_cast<int64_t>(w.layers[0].wq.dim(0)), c.num_attention_heads * c.head_dim());
}

INSTANTIATE_TEST_SUITE_P(
    HuggingFaceFamilies, AttnVariantGradCheck,
    ::testing::Values(AttnVariant{"qwen2", true, false, false, 0, Recompute::kNone},
                      AttnVariant{"llama_attention_bias", true, true, false, 0, Recompute::kNone},
                      AttnVariant{"qwen3", false, false, true, 6, Recompute::kNone},
                      AttnVariant{"qwen3_bias_recompute", true, true, true, 6, Recompute::kBlock},
                      AttnVariant{"llama_mlp_bias", false, false, false, 0, Recompute::kNone, true},
                      AttnVariant{"llama_all_biases_recompute", true, true, false, 0, Recompute::kBlock, true}),
    [](const ::testing::TestParamInfo<AttnVariant>& p) { return std::string(p.param.name); });

}  // namespace
}  // namespace foldpar
