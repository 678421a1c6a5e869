// The model's sub-blocks (model/sub_blocks.h, lm_head.h) one at a time: each backward against
// fp64 central differences of its forward along random directions, the accumulate/overwrite
// contract of the backward, the MLP's column chunks against the whole MLP (what TSP's ring
// computes), the step order (model/step_order.h) against a recording ModelStep, and the
// zero-bubble split of a block's backward (model/weight_grad_queue.h) against the direct one.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/rope_table.h"
#include "core/tolerance.h"
#include "model/llama_block.h"
#include "model/llama_weights.h"
#include "model/lm_head.h"
#include "model/step_order.h"
#include "model/sub_blocks.h"
#include "model/weight_grad_queue.h"
#include "tensor/compare.h"
#include "test_util.h"

namespace foldpar {
namespace {

using testing::random_tensor;

double dot(const Tensor& a, const Tensor& b) {
  return std::inner_product(a.data<double>(), a.data<double>() + a.numel(), b.data<double>(), 0.0);
}

// The directional derivative of loss() along a few random u by central differences against
// <analytic, u>, relative to |analytic| |u| (its Cauchy-Schwarz bound): a wrong formula is off
// by order 1, the differences by kF64FiniteDifference at most.
void expect_directional(const char* what, Tensor& param, const Tensor& analytic, const std::function<double()>& loss) {
  ASSERT_EQ(param.dtype(), DType::kF64);
  ASSERT_EQ(param.numel(), analytic.numel()) << what;
  double* p = param.data<double>();
  const double h = tol::kFiniteDifferenceStep;
  for (uint64_t k = 0; k < 3; ++k) {
    const Tensor u = random_tensor(param.shape(), DType::kF64, 900 + k);
    const Tensor saved = param.clone(MemCategory::kWorkspace);
    for (int64_t i = 0; i < param.numel(); ++i) p[i] = saved.data<double>()[i] + h * u.data<double>()[i];
    const double up = loss();
    for (int64_t i = 0; i < param.numel(); ++i) p[i] = saved.data<double>()[i] - h * u.data<double>()[i];
    const double down = loss();
    for (int64_t i = 0; i < param.numel(); ++i) p[i] = saved.data<double>()[i];
    const double numeric = (up - down) / (2 * h), exact = dot(analytic, u);
    const double bound = std::sqrt(dot(analytic, analytic) * dot(u, u)) + 1e-30;
    EXPECT_LE(std::abs(numeric - exact), tol::kF64FiniteDifference * bound)
        << what << " direction " << k << ": numeric " << numeric << " analytic " << exact << " (bound " << bound << ")";
  }
}

// d = 4; f = 24 splits into three chunks of 8.
LlamaConfig small_config() {
  LlamaConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.num_hidden_layers = 2;
  c.vocab_size = 11;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  return c;
}

class SubBlocks : public ::testing::Test {
 protected:
  static constexpr int64_t B = 2, S = 3, T = B * S;
  SubBlocks() {
    positions_ = testing::i32_tensor({S}, {4, 0, 9});  // not 0..S-1: RoPE must use them
    rope_ = build_rope_table(*make_reference_backend(), {positions_.data<int32_t>(), static_cast<size_t>(S)}, c_.head_dim(), c_.rope_theta,
                             DType::kF64);
    ctx_ = BlockContext{&c_, be_.get(), B, S, &positions_, &rope_};
  }
  static Tensor f64(const Shape& s, uint64_t seed, double scale = 1.0) {
    return random_tensor(s, DType::kF64, seed, scale);
  }
  static Tensor zeros64(const Shape& s) { return Tensor::zeros(s, DType::kF64, MemCategory::kWorkspace); }

  LlamaConfig c_ = small_config();
  std::unique_ptr<Backend> be_ = make_reference_backend();
  Tensor positions_, rope_;
  BlockContext ctx_;
  const int64_t h = c_.hidden_size, d = c_.head_dim();
};

TEST_F(SubBlocks, NormBackwardAddsTheResidualGradient) {
  Tensor x = f64({T, h}, 1), gain = f64({h}, 2), r_a = f64({T, h}, 3), r_x = f64({T, h}, 4);
  // loss = <r_a, norm(x)> + <r_x, x>: r_x is the gradient reaching x around the sub-block.
  auto loss = [&] { return dot(r_a, norm_forward(ctx_, gain, x).a) + dot(r_x, x); };
  const NormSaved s = norm_forward(ctx_, gain, x);
  Tensor g_gain = zeros64({h});
  const Tensor dx = norm_backward(ctx_, gain, s, r_a, &r_x, g_gain);
  expect_directional("norm x", x, dx, loss);
  expect_directional("norm gain", gain, g_gain, loss);
}

TEST_F(SubBlocks, QkvBackwardOfAHeadSlice) {
  const int64_t n_q = 2, n_k = 1;  // a slice: half the query and KV heads
  Tensor a = f64({T, h}, 5);
  QkvWeights w{f64({n_q * d, h}, 6), f64({n_k * d, h}, 7), f64({n_k * d, h}, 8)};
  const Tensor rq = f64({B, S, n_q, d}, 9), rk = f64({B, S, n_k, d}, 10), rv = f64({B, S, n_k, d}, 11);
  auto loss = [&] {
    const QkvSaved s = qkv_forward(ctx_, w, a);
    return dot(rq, s.q) + dot(rk, s.k) + dot(rv, s.v);
  };
  QkvWeights g{zeros64(w.wq.shape()), zeros64(w.wk.shape()), zeros64(w.wv.shape())};
  Tensor dq = rq.clone(MemCategory::kWorkspace), dk = rk.clone(MemCategory::kWorkspace), d_a;
  q_backward(ctx_, w, a, dq, d_a, g, 1.0f);
  kv_backward(ctx_, w, a, dk, rv, d_a, g, 1.0f);
  expect_directional("qkv a", a, d_a, loss);
  expect_directional("qkv wq", w.wq, g.wq, loss);
  expect_directional("qkv wk", w.wk, g.wk, loss);
  expect_directional("qkv wv", w.wv, g.wv, loss);

  // A defined d_a accumulates; g_beta 0 overwrites whatever the gradient held. Only the order
  // of the sums into d_a differs (f64: a few ulp, far inside the order-of-summation bound; a
  // dropped or overwritten term would be off by order 1).
  const Tensor offset = f64(a.shape(), 15);
  Tensor d_a2 = offset.clone(MemCategory::kWorkspace), want = offset.clone(MemCategory::kWorkspace);
  be_->add_inplace(d_a, want);
  QkvWeights g2{f64(w.wq.shape(), 12), f64(w.wk.shape(), 13), f64(w.wv.shape(), 14)};
  dq = rq.clone(MemCategory::kWorkspace);
  dk = rk.clone(MemCategory::kWorkspace);
  q_backward(ctx_, w, a, dq, d_a2, g2, 0.0f);
  kv_backward(ctx_, w, a, dk, rv, d_a2, g2, 0.0f);
  EXPECT_TRUE(testing::near_rel(d_a2, want, tol::kF32Parallel));
  EXPECT_TRUE(testing::near_rel(g2.wq, g.wq, 0.0));
  EXPECT_TRUE(testing::near_rel(g2.wk, g.wk, 0.0));
  EXPECT_TRUE(testing::near_rel(g2.wv, g.wv, 0.0));
}

// The weight in Hugging Face's [out, in] or transposed [in, out] storage (TSP's packing).
Tensor transposed(const Tensor& w) {
  Tensor t = Tensor::empty({w.dim(1), w.dim(0)}, w.dtype(), MemCategory::kWorkspace);
  for (int64_t i = 0; i < w.dim(0); ++i)
    for (int64_t j = 0; j < w.dim(1); ++j) {
      if (w.dtype() == DType::kF64) {
        t.data<double>()[j * w.dim(0) + i] = w.data<double>()[i * w.dim(1) + j];
      } else {
        t.data<float>()[j * w.dim(0) + i] = w.data<float>()[i * w.dim(1) + j];
      }
    }
  return t;
}

class SubBlocksStorage : public SubBlocks, public ::testing::WithParamInterface<bool> {};

TEST_P(SubBlocksStorage, AttentionOutputBackward) {
  const bool t = GetParam();
  const int64_t n_q = 2;
  Tensor x = f64({T, h}, 15), attn = f64({B, S, n_q, d}, 16), r = f64({T, h}, 17);
  LinearView wo{t ? f64({n_q * d, h}, 18) : f64({h, n_q * d}, 18), t};
  auto loss = [&] {
    Tensor y = residual_forward(ctx_, x);
    attn_output_forward(ctx_, wo, attn, y);
    return dot(r, y);
  };
  LinearView g{zeros64(wo.w.shape()), t};
  const Tensor d_attn = attn_output_backward(ctx_, wo, attn, r, g, 1.0f);
  expect_directional("o_proj attn", attn, d_attn, loss);
  expect_directional("o_proj weight", wo.w, g.w, loss);
  expect_directional("o_proj residual", x, r, loss);
}

TEST_P(SubBlocksStorage, MlpChunkBackward) {
  const bool t = GetParam();
  const int64_t fc = 8;  // a chunk of f = 24
  Tensor a = f64({T, h}, 19), r = f64({T, h}, 20);
  MlpWeights w{f64({fc, h}, 21), f64({fc, h}, 22), LinearView{t ? f64({fc, h}, 23) : f64({h, fc}, 23), t}};
  auto loss = [&] {
    Tensor y = zeros64({T, h});
    mlp_forward(ctx_, w, a, y, nullptr);
    return dot(r, y);
  };
  Tensor y = zeros64({T, h});
  MlpSaved s;
  int between = 0;
  mlp_forward(ctx_, w, a, y, &s, [&] { ++between; });
  EXPECT_EQ(between, 1);
  MlpWeights g{zeros64({fc, h}), zeros64({fc, h}), LinearView{zeros64(w.down.w.shape()), t}};
  Tensor d_a;
  mlp_backward(ctx_, w, s, a, r, d_a, g, 1.0f);
  expect_directional("mlp a", a, d_a, loss);
  expect_directional("mlp gate", w.w_gate, g.w_gate, loss);
  expect_directional("mlp up", w.w_up, g.w_up, loss);
  expect_directional("mlp down", w.down.w, g.down.w, loss);
}

INSTANTIATE_TEST_SUITE_P(HuggingFaceAndTransposed, SubBlocksStorage, ::testing::Bool());

// D column chunks of f/D, each with its slice of gate/up rows and down columns (stored
// transposed, as TSP packs them), sum to the whole MLP: forward, d_a and every weight
// gradient. f32: only the order of the sums over chunks differs.
TEST_F(SubBlocks, MlpColumnChunksComposeToTheWholeMlp) {
  const int64_t f = c_.intermediate_size, D = 3, fc = f / D;
  auto f32 = [](const Shape& s, uint64_t seed) { return random_tensor(s, DType::kF32, seed); };
  const Tensor a = f32({T, h}, 24), dy = f32({T, h}, 25);
  const MlpWeights w{f32({f, h}, 26), f32({f, h}, 27), LinearView{f32({h, f}, 28), false}};
  const Tensor down_t = transposed(w.down.w);  // [f, h]
  auto zeros = [](const Shape& s) { return Tensor::zeros(s, DType::kF32, MemCategory::kWorkspace); };

  Tensor y_full = zeros({T, h}), d_a_full;
  MlpSaved s_full;
  mlp_forward(ctx_, w, a, y_full, &s_full);
  MlpWeights g_full{zeros({f, h}), zeros({f, h}), LinearView{zeros({h, f}), false}};
  mlp_backward(ctx_, w, s_full, a, dy, d_a_full, g_full, 1.0f);
  const Tensor g_down_t = transposed(g_full.down.w);

  Tensor y = zeros({T, h}), d_a = zeros({T, h});
  for (int64_t c = 0; c < D; ++c) {
    const MlpWeights wc{w.w_gate.narrow(c * fc, (c + 1) * fc), w.w_up.narrow(c * fc, (c + 1) * fc),
                        LinearView{down_t.narrow(c * fc, (c + 1) * fc), true}};
    MlpSaved s;
    mlp_forward(ctx_, wc, a, y, &s);
    MlpWeights gc{f32({fc, h}, 30), f32({fc, h}, 31), LinearView{f32({fc, h}, 32), true}};  // overwritten: beta 0
    mlp_backward(ctx_, wc, s, a, dy, d_a, gc, 0.0f);
    EXPECT_TRUE(testing::near_rel(gc.w_gate, g_full.w_gate.narrow(c * fc, (c + 1) * fc), tol::kF32Parallel)) << c;
    EXPECT_TRUE(testing::near_rel(gc.w_up, g_full.w_up.narrow(c * fc, (c + 1) * fc), tol::kF32Parallel)) << c;
    EXPECT_TRUE(testing::near_rel(gc.down.w, g_down_t.narrow(c * fc, (c + 1) * fc), tol::kF32Parallel)) << c;
  }
  EXPECT_TRUE(testing::near_rel(y, y_full, tol::kF32Parallel));
  EXPECT_TRUE(testing::near_rel(d_a, d_a_full, tol::kF32Parallel));
}

TEST_F(SubBlocks, HeadAndLossBackward) {
  const int64_t V = c_.vocab_size;
  Tensor x = f64({T, h}, 33);
  HeadWeights w{f64({h}, 34), f64({V, h}, 35)};
  const Tensor targets = testing::i32_tensor({T}, {3, -100, 10, 0, 7, -100});
  auto loss = [&] {
    HeadSaved hs;
    return head_forward(ctx_, w, x, targets, -100, hs).loss_sum / 4.0;
  };
  HeadSaved hs;
  const LossSums sums = head_forward(ctx_, w, x, targets, -100, hs);
  EXPECT_EQ(sums.valid_tokens, 4);
  HeadWeights g{zeros64({h}), zeros64({V, h})};
  const Tensor dx = head_backward(ctx_, w, hs, targets, -100, 1.0 / 4.0, g);
  EXPECT_FALSE(hs.logits.defined()) << "the backward releases the logits";
  expect_directional("head x", x, dx, loss);
  expect_directional("head final_norm", w.final_norm, g.final_norm, loss);
  expect_directional("head lm_head", w.lm_head, g.lm_head, loss);
}

// A ModelStep that records the order of its calls and checks the tensors it is handed.
class RecordingStep final : public ModelStep {
 public:
  std::vector<std::string> calls;
  std::vector<const void*> block_inputs;  // forward inputs by layer, first pass

  Tensor embed_forward() override {
    calls.push_back("embed");
    return fresh();
  }
  Tensor block_forward(int64_t l, const Tensor& x, bool save) override {
    calls.push_back("block" + std::to_string(l) + (save ? "+save" : ""));
    if (block_inputs.size() == static_cast<size_t>(l)) block_inputs.push_back(x.raw_data());
    reruns_match = reruns_match && x.raw_data() == block_inputs[l];
    return fresh();
  }
  StepResult head_forward(const Tensor&, bool save) override {
    calls.push_back(save ? "head+save" : "head");
    StepResult r;
    r.valid_tokens = 7;
    return r;
  }
  Tensor head_backward(const StepResult& r) override {
    calls.push_back("head_backward" + std::to_string(r.valid_tokens));
    return fresh();
  }
  Tensor block_backward(int64_t l, Tensor) override {
    calls.push_back("block_backward" + std::to_string(l));
    return fresh();
  }
  void embed_backward(const Tensor&) override { calls.push_back("embed_backward"); }

  bool reruns_match = true;

 private:
  static Tensor fresh() { return Tensor::zeros({1, 1}, DType::kF32, MemCategory::kWorkspace); }
};

TEST(StepOrder, ForwardOnly) {
  RecordingStep step;
  step_forward(step, 2);
  EXPECT_EQ(step.calls, (std::vector<std::string>{"embed", "block0", "block1", "head"}));
}

TEST(StepOrder, ForwardBackwardKeepingActivations) {
  RecordingStep step;
  const StepResult r = step_forward_backward(step, 2, Recompute::kNone);
  EXPECT_EQ(r.valid_tokens, 7);
  EXPECT_EQ(step.calls, (std::vector<std::string>{"embed", "block0+save", "block1+save", "head+save",
                                                  "head_backward7", "block_backward1", "block_backward0",
                                                  "embed_backward"}));
}

TEST(StepOrder, RecomputeRerunsEachBlockOnItsOwnInputBeforeItsBackward) {
  RecordingStep step;
  step_forward_backward(step, 2, Recompute::kBlock);
  EXPECT_EQ(step.calls, (std::vector<std::string>{"embed", "block0", "block1", "head+save", "head_backward7",
                                                  "block1+save", "block_backward1", "block0+save",
                                                  "block_backward0", "embed_backward"}));
  EXPECT_TRUE(step.reruns_match) << "a rerun must see the tensor its forward saw";
}

// A block's backward with its weight-gradient products queued (ZB-H1's B): the input gradient
// and the gradients of the norm gains, the biases and the q/k norms exactly the direct
// backward's, the seven weight matrices untouched; running the queue (W) then gives the
// direct backward's weight gradients bit for bit (the same products on the same operands, the
// operands held by the queue after the saved state is gone).
TEST(WeightGradQueue, DeferredBlockBackwardEqualsTheDirectOne) {
  LlamaConfig c = small_config();
  c.qkv_bias = c.o_bias = c.qk_norm = c.mlp_bias = true;
  constexpr int64_t B = 2, S = 3;
  auto be = make_reference_backend();
  const Tensor positions = testing::i32_tensor({S}, {0, 1, 2});
  const Tensor rope = build_rope_table(*be, {positions.data<int32_t>(), static_cast<size_t>(S)}, c.head_dim(),
                                       c.rope_theta, DType::kF32);
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(InitOptions{.seed = 3, .std = 0.1, .norm_jitter = 0.2}, w);
  const Tensor x = random_tensor({B * S, c.hidden_size}, DType::kF32, 5);
  const Tensor dy = random_tensor({B * S, c.hidden_size}, DType::kF32, 6);
  auto backward = [&](WeightGradQueue* queue, LlamaWeights& g) {
    BlockContext ctx{&c, be.get(), B, S, &positions, &rope};
    BlockSaved saved;
    block_forward(ctx, w.layers[0], x, &saved);
    ctx.weight_grads = queue;
    return block_backward(ctx, w.layers[0], saved, dy, g.layers[0]);
  };
  LlamaWeights direct = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  LlamaWeights split = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
  direct.zero();
  split.zero();
  const Tensor dx_direct = backward(nullptr, direct);
  WeightGradQueue queue;
  const Tensor dx_split = backward(&queue, split);
  EXPECT_EQ(max_rel_error(dx_split, dx_direct), 0.0);
  EXPECT_EQ(queue.size(), 7u) << "q, k, v, o, down, gate, up";
  EXPECT_GT(queue.held_bytes(), 0);
  const LayerWeights& d = direct.layers[0];
  LayerWeights& g = split.layers[0];
  const std::vector<std::pair<const Tensor*, const Tensor*>> in_b = {
      {&g.attn_norm, &d.attn_norm}, {&g.mlp_norm, &d.mlp_norm}, {&g.bq, &d.bq}, {&g.bk, &d.bk}, {&g.bv, &d.bv},
      {&g.bo, &d.bo}, {&g.q_norm, &d.q_norm}, {&g.k_norm, &d.k_norm}, {&g.b_gate, &d.b_gate}, {&g.b_up, &d.b_up},
      {&g.b_down, &d.b_down}};
  for (const auto& [got, want] : in_b) EXPECT_EQ(max_rel_error(*got, *want), 0.0) << want->describe();
  const std::vector<std::pair<const Tensor*, const Tensor*>> in_w = {
      {&g.wq, &d.wq}, {&g.wk, &d.wk}, {&g.wv, &d.wv}, {&g.wo, &d.wo}, {&g.w_gate, &d.w_gate}, {&g.w_up, &d.w_up},
      {&g.w_down, &d.w_down}};
  for (const auto& [got, want] : in_w) {
    const Tensor zero = Tensor::zeros(got->shape(), DType::kF32, MemCategory::kWorkspace);
    EXPECT_EQ(max_rel_error(*got, zero), 0.0) << "a weight gradient written before W";
  }
  queue.run(*be);
  EXPECT_TRUE(queue.empty());
  EXPECT_EQ(queue.held_bytes(), 0);
  for (const auto& [got, want] : in_w) EXPECT_EQ(max_rel_error(*got, *want), 0.0) << want->describe();
}

// Actions (what moves a weight gradient after its products: TSP's reduce and ring) run in
// the recorded order between the products, each once, and hold no operand bytes.
TEST(WeightGradQueue, ActionsRunInOrderBetweenTheProducts) {
  auto be = make_reference_backend();
  Tensor a = Tensor::empty({2, 2}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t i = 0; i < 4; ++i) a.data<float>()[i] = static_cast<float>(i + 1);  // [[1, 2], [3, 4]]
  Tensor c = Tensor::zeros({2, 2}, DType::kF32, MemCategory::kGradients);
  std::vector<float> seen;  // c[0][0] when each action runs
  WeightGradQueue queue;
  queue.push_action([&] { seen.push_back(c.data<float>()[0]); });
  queue.push(a, true, a, false, c, 0.0f);  // c = a^T a: c[0][0] = 1 + 9
  queue.push_action([&] { seen.push_back(c.data<float>()[0]); });
  queue.push(a, true, a, false, c, 1.0f);  // c += a^T a
  queue.push_action([&] { seen.push_back(c.data<float>()[0]); });
  EXPECT_EQ(queue.size(), 5u);
  EXPECT_EQ(queue.held_bytes(), static_cast<int64_t>(a.nbytes()));
  EXPECT_TRUE(seen.empty()) << "an action ran before W";
  queue.run(*be);
  EXPECT_EQ(seen, (std::vector<float>{0.0f, 10.0f, 20.0f}));
  EXPECT_TRUE(queue.empty());
}

}  // namespace
}  // namespace foldpar
