// The mixture-of-experts layer: its backend ops (the fast CPU backend against the
// reference, ties, hand-worked values), fp64 finite differences of the routing and of every
// parameter of Mixtral-, Qwen2-MoE- and Qwen3-MoE-like tiny models (aux loss included), the
// fast backend's model against the reference's, the aux loss's known value, and the MoE
// config fields and tensor names.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "app/verify.h"
#include "backend/backend.h"
#include "checkpoint/hf_directory.h"
#include "core/tolerance.h"
#include "model/llama_model.h"
#include "model/moe_layer.h"
#include "model/moe_weights.h"
#include "parallel/sharded_weights.h"
#include "parallel/tsp/tsp_model.h"
#include "test_util.h"

namespace foldpar {
namespace {

using testing::expect_gradient;
using testing::near_rel;
using testing::random_tensor;

Tensor empty(const Shape& s, DType d) { return Tensor::empty(s, d, MemCategory::kWorkspace); }

// ---- the ops ----

TEST(MoeOps, RoutingTiesGoToTheLowerExpertIndex) {
  for (auto make : {make_reference_backend, make_cpu_backend}) {
    auto be = make();
    // Row 0: experts 1 and 2 tie above 3; row 1: all equal.
    Tensor logits = empty({2, 4}, DType::kF32);
    const float v[] = {0.0f, 1.0f, 1.0f, 0.5f, 2.0f, 2.0f, 2.0f, 2.0f};
    std::copy(v, v + 8, logits.data<float>());
    Tensor probs = empty({2, 4}, DType::kF32), w = empty({2, 3}, DType::kF32);
    Tensor ex = empty({2, 3}, DType::kI32);
    be->moe_route_forward(logits, true, probs, w, ex);
    const int32_t* e = ex.data<int32_t>();
    EXPECT_EQ(std::vector<int32_t>(e, e + 6), (std::vector<int32_t>{1, 2, 3, 0, 1, 2})) << be->name();
    EXPECT_NEAR(w.data<float>()[3], 1.0f / 3, 1e-6) << be->name();  // renormalised: three equal weights
    const double z = 1 + 2 * std::exp(1.0) + std::exp(0.5);
    EXPECT_NEAR(w.data<float>()[0], std::exp(1.0) / z / ((2 * std::exp(1.0) + std::exp(0.5)) / z), 1e-6);
    be->moe_route_forward(logits, false, probs, w, ex);
    EXPECT_NEAR(w.data<float>()[0], std::exp(1.0) / z, 1e-6) << be->name();  // plain softmax probability
  }
}

TEST(MoeOps, FastCpuMatchesTheReference) {
  auto ref = make_reference_backend(), cpu = make_cpu_backend();
  const int64_t T = 37, E = 8, k = 3, h = 12, M = T * k;
  const Tensor logits = random_tensor({T, E}, DType::kF32, 1, 2.0);
  for (bool normalize : {false, true}) {
    Tensor p[2], w[2], x[2], dl[2];
    Backend* bes[2] = {ref.get(), cpu.get()};
    const Tensor dw = random_tensor({T, k}, DType::kF32, 2), bias = random_tensor({E}, DType::kF32, 3);
    for (int b = 0; b < 2; ++b) {
      p[b] = empty({T, E}, DType::kF32), w[b] = empty({T, k}, DType::kF32), x[b] = empty({T, k}, DType::kI32);
      bes[b]->moe_route_forward(logits, normalize, p[b], w[b], x[b]);
      dl[b] = empty({T, E}, DType::kF32);
      bes[b]->moe_route_backward({&p[0], &w[0], &x[0], &dw, &bias, normalize}, dl[b]);
    }
    EXPECT_EQ(std::memcmp(x[0].raw_data(), x[1].raw_data(), x[0].nbytes()), 0);
    EXPECT_TRUE(near_rel(p[1], p[0], tol::kF32Op));
    EXPECT_TRUE(near_rel(w[1], w[0], tol::kF32Op));
    EXPECT_TRUE(near_rel(dl[1], dl[0], tol::kF32Op));
  }
  const Tensor src = random_tensor({T, h}, DType::kF32, 4), scale = random_tensor({M}, DType::kF32, 5);
  Tensor rows = empty({M}, DType::kI32);
  for (int64_t i = 0; i < M; ++i) rows.data<int32_t>()[i] = static_cast<int32_t>((i * 7 + 3) % T);
  for (const Tensor* s : {static_cast<const Tensor*>(nullptr), &scale}) {
    Tensor g0 = empty({M, h}, DType::kF32), g1 = empty({M, h}, DType::kF32);
    ref->gather_rows(src, rows, s, g0);
    cpu->gather_rows(src, rows, s, g1);
    EXPECT_TRUE(near_rel(g1, g0, tol::kF32Op));
    Tensor d0 = src.clone(MemCategory::kWorkspace), d1 = src.clone(MemCategory::kWorkspace);
    ref->scatter_add_rows(g0, rows, s, d0);
    cpu->scatter_add_rows(g0, rows, s, d1);
    EXPECT_TRUE(near_rel(d1, d0, tol::kF32Op));
  }
  const Tensor a = random_tensor({M, h}, DType::kF32, 6), b = random_tensor({M, h}, DType::kF32, 7);
  Tensor o0 = empty({M}, DType::kF32), o1 = empty({M}, DType::kF32);
  ref->rows_dot(a, b, o0);
  cpu->rows_dot(a, b, o1);
  EXPECT_TRUE(near_rel(o1, o0, tol::kF32Op));
  Tensor s0 = empty({M, h}, DType::kF32), s1 = empty({M, h}, DType::kF32);
  ref->sigmoid_forward(a, s0);
  cpu->sigmoid_forward(a, s1);
  EXPECT_TRUE(near_rel(s1, s0, tol::kF32Op));
  Tensor db0 = empty({M, h}, DType::kF32), db1 = empty({M, h}, DType::kF32);
  ref->sigmoid_backward(s0, b, db0);
  cpu->sigmoid_backward(s0, b, db1);
  EXPECT_TRUE(near_rel(db1, db0, tol::kF32Op));
}

TEST(MoeOps, GatherAndScatterMoveTheListedRows) {
  for (auto make : {make_reference_backend, make_cpu_backend}) {
    auto be = make();
    Tensor src = empty({3, 2}, DType::kF32);
    for (int i = 0; i < 6; ++i) src.data<float>()[i] = static_cast<float>(i + 1);  // rows (1,2) (3,4) (5,6)
    const Tensor rows = testing::i32_tensor({4}, {2, 0, 2, 1});
    Tensor scale = empty({4}, DType::kF32);
    const float sv[] = {1.0f, 2.0f, -1.0f, 0.5f};
    std::copy(sv, sv + 4, scale.data<float>());
    Tensor g = empty({4, 2}, DType::kF32);
    be->gather_rows(src, rows, &scale, g);
    const float want_g[] = {5, 6, 2, 4, -5, -6, 1.5f, 2};
    for (int i = 0; i < 8; ++i) EXPECT_EQ(g.data<float>()[i], want_g[i]) << be->name() << " " << i;
    Tensor d = empty({3, 2}, DType::kF32);
    be->fill(0.0, d);
    be->scatter_add_rows(g, rows, &scale, d);  // row 2 gets 1*(5,6) - 1*(-5,-6)
    const float want_d[] = {4, 8, 0.75f, 1, 10, 12};
    for (int i = 0; i < 6; ++i) EXPECT_EQ(d.data<float>()[i], want_d[i]) << be->name() << " " << i;
    Tensor dots = empty({4}, DType::kF32);
    be->rows_dot(g, g, dots);
    EXPECT_EQ(dots.data<float>()[0], 61.0f);
  }
}

// ---- fp64 finite differences ----

double dot64(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.data<double>()[i] * b.data<double>()[i];
  return s;
}

TEST(MoeOps, RoutingBackwardIsTheAdjointOfItsForward) {
  auto be = make_reference_backend();
  const int64_t T = 6, E = 5, k = 2;
  Tensor logits = random_tensor({T, E}, DType::kF64, 11, 1.5);
  const Tensor r = random_tensor({T, k}, DType::kF64, 12), bias = random_tensor({E}, DType::kF64, 13);
  for (bool normalize : {false, true}) {
    // loss = <r, weights> + sum_t <bias, p[t, :]>
    auto loss = [&] {
      Tensor p = empty({T, E}, DType::kF64), w = empty({T, k}, DType::kF64), x = empty({T, k}, DType::kI32);
      be->moe_route_forward(logits, normalize, p, w, x);
      double s = dot64(r, w);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < E; ++e) s += bias.data<double>()[e] * p.data<double>()[t * E + e];
      return s;
    };
    Tensor p = empty({T, E}, DType::kF64), w = empty({T, k}, DType::kF64), x = empty({T, k}, DType::kI32);
    be->moe_route_forward(logits, normalize, p, w, x);
    Tensor dl = empty({T, E}, DType::kF64);
    be->moe_route_backward({&p, &w, &x, &r, &bias, normalize}, dl);
    expect_gradient(normalize ? "route renormalised" : "route", logits, dl, loss, 64, 1);
  }
}

LlamaConfig moe_config(MoeFamily family) {
  LlamaConfig c;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.num_hidden_layers = 3;
  c.vocab_size = 11;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  MoeConfig& m = c.moe;
  m.family = family;
  m.num_experts = 4;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = family == MoeFamily::kMixtral ? c.intermediate_size : 6;
  m.norm_topk_prob = family != MoeFamily::kQwen2;
  m.router_aux_loss_coef = 0.25;
  m.output_router_logits = true;
  if (family == MoeFamily::kQwen2) {
    m.shared_expert_intermediate_size = 10;
    m.mlp_only_layers = {2};  // layers 0 and 1 sparse, 2 dense
  }
  if (family == MoeFamily::kQwen3) m.decoder_sparse_step = 2;  // only layer 1 sparse
  return c;
}

Batch tiny_batch() {
  Batch b;
  b.input_ids = testing::i32_tensor({2, 5}, {1, 5, 7, 2, 10, 0, 3, 3, 9, 4});
  b.target_ids = testing::i32_tensor({2, 5}, {5, 7, 2, 10, -100, 3, 3, 9, 4, 8});
  return b;
}

// fp64 finite differences of `loss` against every parameter's analytic gradient in g.
void expect_every_gradient(LlamaWeights& w, LlamaWeights& g, const std::function<double()>& loss) {
  std::vector<std::pair<std::string, Tensor>> grads;
  g.for_each([&](const std::string& name, Tensor& t) { grads.emplace_back(name, t); });
  size_t i = 0;
  w.for_each([&](const std::string& name, Tensor& t) {
    ASSERT_EQ(grads[i].first, name);
    expect_gradient(name, t, grads[i].second, loss, 12, 1);
    ++i;
  });
  EXPECT_EQ(i, grads.size());
}

class MoeModelGradCheck : public ::testing::TestWithParam<std::tuple<MoeFamily, Recompute, bool>> {};

TEST_P(MoeModelGradCheck, EveryParameterWithTheAuxLoss) {
  const auto [family, recompute, per_layer] = GetParam();
  LlamaConfig c = moe_config(family);
  c.moe.aux_per_layer = per_layer;
  ASSERT_TRUE(c.validate().ok()) << c.validate().to_string();
  auto be = make_reference_backend();
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF64, MemCategory::kParameters);
  init_weights(InitOptions{.seed = 5, .std = 0.5, .norm_jitter = 0.3}, w);
  LlamaWeights g = LlamaWeights::allocate(c, DType::kF64, MemCategory::kGradients);
  g.zero();
  const Batch batch = tiny_batch();
  StepOptions opts;
  opts.recompute = recompute;
  Result<StepResult> r = model_forward_backward(c, *be, w, batch, opts, g);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_GT(r->aux_loss, 0);
  EXPECT_NEAR(r->loss, r->loss_sum / 9 + 0.25 * r->aux_loss, 1e-14);
  int64_t load = 0;
  for (int64_t n : r->expert_load) load += n;
  EXPECT_EQ(load, c.moe.sparse_layer_count(3) * 10 * 2);
  auto loss = [&] { return model_forward(c, *be, w, batch, {}).value().loss; };
  EXPECT_NEAR(loss(), r->loss, 1e-14);
  expect_every_gradient(w, g, loss);
}

INSTANTIATE_TEST_SUITE_P(Families, MoeModelGradCheck,
                         ::testing::Values(std::make_tuple(MoeFamily::kMixtral, Recompute::kNone, false),
                                           std::make_tuple(MoeFamily::kQwen2, Recompute::kNone, false),
                                           std::make_tuple(MoeFamily::kQwen3, Recompute::kNone, false),
                                           std::make_tuple(MoeFamily::kQwen2, Recompute::kBlock, false),
                                           std::make_tuple(MoeFamily::kMixtral, Recompute::kNone, true)));

TEST(MoeOps, CapacityKeepsEachExpertsFirstPairsOfASequence) {
  // 2 sequences of 3 tokens, k = 2, E = 3, capacity 2: in sequence 0 expert 0's third pair
  // (token 2, slot 0) goes; in sequence 1 expert 2's (token 2, slot 1). Counts restart per
  // sequence: expert 2 keeps two pairs in sequence 1 although it had one in sequence 0.
  std::vector<int32_t> e{0, 1, 0, 2, 0, 1, 2, 1, 2, 0, 1, 2};
  std::vector<int32_t> unchanged = e;
  EXPECT_EQ(moe_drop_over_capacity(unchanged, 2, 3, 2, 3, 0), 0);  // capacity 0: dropless
  EXPECT_EQ(unchanged, e);
  EXPECT_EQ(moe_drop_over_capacity(e, 2, 3, 2, 3, 2), 2);
  const int32_t x = kDroppedExpert;
  EXPECT_EQ(e, (std::vector<int32_t>{0, 1, 0, 2, x, 1, 2, 1, 2, 0, 1, x}));
  MoeConfig m;
  m.num_experts = 8;
  m.num_experts_per_tok = 2;
  EXPECT_EQ(m.expert_capacity(100), 0);  // no factor: no limit
  m.capacity_factor = 1.25;
  EXPECT_EQ(m.expert_capacity(100), 32);  // ceil(1.25 * 100 * 2 / 8) = ceil(31.25)
  m.capacity_factor = -1;
  EXPECT_FALSE(m.validate(1).ok());
}

TEST(MoeModel, CapacityDropsAndEveryGradientStillChecks) {
  // ceil(0.5 * 5 * 2 / 4) = 2 of each sequence's 10 pairs per expert: some go (the loss moves),
  // and fp64 finite differences still match every gradient (the drop is fixed near the point,
  // as the top-k choice is). The aux statistics count the choices before the drop.
  LlamaConfig c = moe_config(MoeFamily::kMixtral);
  auto be = make_reference_backend();
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF64, MemCategory::kParameters);
  init_weights(InitOptions{.seed = 5, .std = 0.5, .norm_jitter = 0.3}, w);
  const Batch batch = tiny_batch();
  const StepResult dropless = model_forward(c, *be, w, batch, {}).value();
  c.moe.capacity_factor = 0.5;
  ASSERT_TRUE(c.validate().ok());
  ASSERT_EQ(c.moe.expert_capacity(5), 2);
  LlamaWeights g = LlamaWeights::allocate(c, DType::kF64, MemCategory::kGradients);
  g.zero();
  Result<StepResult> r = model_forward_backward(c, *be, w, batch, {}, g);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_GT(std::abs(r->loss_sum - dropless.loss_sum), 1e-6 * dropless.loss_sum);
  int64_t load = 0;  // every choice, dropped or not: 3 sparse layers x 10 tokens x k
  for (int64_t n : r->expert_load) load += n;
  EXPECT_EQ(load, 3 * 10 * 2);
  auto loss = [&] { return model_forward(c, *be, w, batch, {}).value().loss; };
  EXPECT_NEAR(loss(), r->loss, 1e-14);
  expect_every_gradient(w, g, loss);
  // A factor large enough for every pair is the dropless model exactly.
  c.moe.capacity_factor = 2.0;  // capacity 5: a sequence's every token
  EXPECT_EQ(model_forward(c, *be, w, batch, {}).value().loss, dropless.loss);
}

TEST(MoeModel, FastCpuMatchesTheReference) {
  for (MoeFamily family : {MoeFamily::kMixtral, MoeFamily::kQwen2}) {
    const LlamaConfig c = moe_config(family);
    auto ref = make_reference_backend(), cpu = make_cpu_backend();
    LlamaWeights w64 = LlamaWeights::allocate(c, DType::kF64, MemCategory::kParameters);
    LlamaWeights w32 = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
    init_weights(InitOptions{.seed = 9, .std = 0.3, .norm_jitter = 0.2}, w64);
    init_weights(InitOptions{.seed = 9, .std = 0.3, .norm_jitter = 0.2}, w32);
    LlamaWeights g64 = LlamaWeights::allocate(c, DType::kF64, MemCategory::kGradients);
    LlamaWeights g32 = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
    g64.zero();
    g32.zero();
    const Batch batch = tiny_batch();
    auto r64 = model_forward_backward(c, *ref, w64, batch, {}, g64);
    auto r32 = model_forward_backward(c, *cpu, w32, batch, {}, g32);
    ASSERT_TRUE(r64.ok() && r32.ok());
    EXPECT_NEAR(r32->loss, r64->loss, tol::kF32Model * std::abs(r64->loss));
    EXPECT_EQ(r32->expert_load, r64->expert_load);
    std::vector<Tensor> want;
    g64.for_each([&](const std::string&, Tensor& t) { want.push_back(t); });
    size_t i = 0;
    g32.for_each(
        [&](const std::string& name, Tensor& t) { EXPECT_TRUE(near_rel(t, want[i++], tol::kF32Model)) << name; });
  }
}

TEST(MoeModel, UniformRouterGivesAnAuxLossOfK) {
  // A zero router gives p = 1/E everywhere, so aux = E * sum_e (C_e / N) / E = sum_e C_e / N = k.
  LlamaConfig c = moe_config(MoeFamily::kMixtral);
  c.moe.num_experts_per_tok = 3;
  auto be = make_reference_backend();
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF64, MemCategory::kParameters);
  init_weights(InitOptions{.seed = 1, .std = 0.5}, w);
  for (auto& l : w.layers) l.moe.router.zero();
  auto r = model_forward(c, *be, w, tiny_batch(), {});
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->aux_loss, 3.0, 1e-12);
  // Per layer: each of the 3 sparse layers scores k on its own.
  c.moe.aux_per_layer = true;
  auto per_layer = model_forward(c, *be, w, tiny_batch(), {});
  ASSERT_TRUE(per_layer.ok());
  EXPECT_NEAR(per_layer->aux_loss, 9.0, 1e-12);
  // Ties go to the lower index: experts 0, 1, 2 take every token, expert 3 none.
  ASSERT_EQ(r->expert_load.size(), 4u);
  for (int e = 0; e < 4; ++e) EXPECT_EQ(r->expert_load[e], e < 3 ? 30 : 0) << "expert " << e;
}

TEST(MoeModel, AuxLossLeavesTheLossAloneWithoutOutputRouterLogits) {
  LlamaConfig c = moe_config(MoeFamily::kQwen3);
  auto be = make_reference_backend();
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF64, MemCategory::kParameters);
  init_weights(InitOptions{.seed = 2, .std = 0.5}, w);
  auto on = model_forward(c, *be, w, tiny_batch(), {});
  c.moe.output_router_logits = false;
  auto off = model_forward(c, *be, w, tiny_batch(), {});
  ASSERT_TRUE(on.ok() && off.ok());
  EXPECT_EQ(off->loss, off->loss_sum / 9);
  EXPECT_NEAR(on->loss - off->loss, 0.25 * off->aux_loss, 1e-14);
  EXPECT_GT(off->aux_loss, 0);
}

// ---- names and configs ----

TEST(MoeWeights, HuggingFaceNamesPerFamily) {
  std::set<std::string> names;
  LlamaWeights mix = LlamaWeights::allocate(moe_config(MoeFamily::kMixtral), DType::kF32, MemCategory::kParameters);
  mix.for_each([&](const std::string& n, const Tensor&) { names.insert(n); });
  EXPECT_TRUE(names.count("model.layers.0.block_sparse_moe.gate.weight"));
  EXPECT_TRUE(names.count("model.layers.2.block_sparse_moe.experts.3.w1.weight"));
  EXPECT_TRUE(names.count("model.layers.2.block_sparse_moe.experts.3.w2.weight"));
  EXPECT_TRUE(names.count("model.layers.2.block_sparse_moe.experts.3.w3.weight"));
  EXPECT_FALSE(names.count("model.layers.0.mlp.gate_proj.weight"));
  names.clear();
  const LlamaConfig qc = moe_config(MoeFamily::kQwen2);
  LlamaWeights q = LlamaWeights::allocate(qc, DType::kF32, MemCategory::kParameters);
  int64_t params = 0;
  q.for_each([&](const std::string& n, const Tensor& t) {
    names.insert(n);
    params += t.numel();
  });
  EXPECT_EQ(params, qc.parameter_count());
  EXPECT_TRUE(names.count("model.layers.1.mlp.gate.weight"));
  EXPECT_TRUE(names.count("model.layers.1.mlp.experts.0.down_proj.weight"));
  EXPECT_TRUE(names.count("model.layers.1.mlp.shared_expert.up_proj.weight"));
  EXPECT_TRUE(names.count("model.layers.1.mlp.shared_expert_gate.weight"));
  EXPECT_TRUE(names.count("model.layers.2.mlp.gate_proj.weight"));  // mlp_only_layers: dense
  EXPECT_FALSE(names.count("model.layers.2.mlp.gate.weight"));
}

TEST(MoeWeights, ExpertsAreViewsIntoTheLayersBlock) {
  // The single-rank layer, a TSP rank's shard (2 of 4 experts) and its flat gradients: one
  // block per layer, expert j's gate, up and down rows from 3 f_e j (the ring sends it whole).
  LlamaConfig c = moe_config(MoeFamily::kMixtral);
  c.vocab_size = 12;  // divisible by tsp=2
  const int64_t h = c.hidden_size, fe = c.moe.moe_intermediate_size;
  MoeLayerWeights w = allocate_moe_layer(c, DType::kF32, MemCategory::kParameters, 0);
  ASSERT_EQ(w.expert_block.shape(), (Shape{c.moe.num_experts * 3 * fe, h}));
  EXPECT_TRUE(experts_are_block_views(w));
  w.expert_block.zero();
  w.experts[1].w_down.data<float>()[fe * 2 + 1] = 7.0f;  // [h, f_e] row 2, column 1
  EXPECT_EQ(w.expert_block.data<float>()[(3 * fe + 2 * fe) * h + fe * 2 + 1], 7.0f);

  Layout opt;
  opt.tsp = 2;
  Result<TspModel> model = TspModel::create(c, opt, 1, 16);
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  ShardedWeights sw = ShardedWeights::allocate(c, model->dims(), 1, DType::kF32, MemCategory::kParameters);
  ShardedGrads sg = ShardedGrads::allocate(c, model->dims(), 1, MemCategory::kGradients);
  size_t sparse = 0;
  for (const ShardedWeights* s : {&sw, &sg.views()})
    for (const MoeLayerWeights& m : s->moe) {
      if (!m.defined()) continue;
      ++sparse;
      EXPECT_EQ(m.experts.size(), 2u);
      EXPECT_TRUE(experts_are_block_views(m));
    }
  EXPECT_EQ(sparse, 2u * 3);  // the three layers of this config, in the weights and the gradients

  // Experts that are not the block's views (reordered, or copied apart) are reported so.
  std::swap(w.experts[0], w.experts[1]);
  EXPECT_FALSE(experts_are_block_views(w));
  std::swap(w.experts[0], w.experts[1]);
  w.experts[2].w_up = w.experts[2].w_up.clone(MemCategory::kParameters);
  EXPECT_FALSE(experts_are_block_views(w));
}

std::string mixtral_json(const std::string& extra) {
  return R"({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 16,
    "intermediate_size": 24, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
    "vocab_size": 32, "sliding_window": null, "num_local_experts": 4, "num_experts_per_tok": 2)" +
         extra + "}";
}

TEST(MoeConfigTest, MixtralLoadsAndRoundTrips) {
  auto c = LlamaConfig::from_json(mixtral_json(R"(, "router_aux_loss_coef": 0.02, "output_router_logits": true)"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->moe.num_experts, 4);
  EXPECT_EQ(c->moe.moe_intermediate_size, 24);
  EXPECT_TRUE(c->moe.norm_topk_prob);
  EXPECT_TRUE(c->moe.is_sparse_layer(0) && c->moe.is_sparse_layer(1));
  auto again = LlamaConfig::from_json(c->to_json());
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(again->to_json(), c->to_json());
  EXPECT_EQ(c->to_json().find("router_aux_loss_per_layer"), std::string::npos);  // Hugging Face's files stay clean
  auto per_layer = LlamaConfig::from_json(mixtral_json(R"(, "router_aux_loss_per_layer": true)"));
  ASSERT_TRUE(per_layer.ok());
  EXPECT_TRUE(per_layer->moe.aux_per_layer);
  EXPECT_TRUE(LlamaConfig::from_json(per_layer->to_json())->moe.aux_per_layer);
  EXPECT_NE(c->to_json().find("\"MixtralForCausalLM\""), std::string::npos);
}

TEST(MoeConfigTest, BadConfigsNameTheValues) {
  auto big_k = LlamaConfig::from_json(R"({"model_type": "mixtral", "hidden_size": 16, "intermediate_size": 24,
    "num_attention_heads": 2, "num_hidden_layers": 2, "vocab_size": 32, "num_local_experts": 4,
    "num_experts_per_tok": 5})");
  ASSERT_FALSE(big_k.ok());
  EXPECT_EQ(big_k.status().message(), "config: num_experts_per_tok (5) must be in [1, num_experts (4)]");
  auto router = LlamaConfig::from_json(mixtral_json(R"(, "scoring_func": "sigmoid")"));
  ASSERT_FALSE(router.ok());
  EXPECT_NE(router.status().message().find("scoring_func"), std::string::npos);
  auto none = LlamaConfig::from_json(R"({"model_type": "mixtral", "hidden_size": 16, "intermediate_size": 24,
    "num_attention_heads": 2, "num_hidden_layers": 2, "vocab_size": 32, "num_experts_per_tok": 2})");
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("num_local_experts"), std::string::npos);
}

TEST(MoeConfigTest, QwenFamiliesAreRefusedForTheirAttentionByName) {
  auto q2 = LlamaConfig::from_json(R"({"model_type": "qwen2_moe", "hidden_size": 16, "intermediate_size": 24,
    "num_attention_heads": 2, "num_hidden_layers": 2, "vocab_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 8, "use_sliding_window": false})");
  ASSERT_FALSE(q2.ok());
  EXPECT_NE(q2.status().message().find("q/k/v biases"), std::string::npos) << q2.status().message();
  auto q3 = LlamaConfig::from_json(R"({"model_type": "qwen3_moe", "hidden_size": 16, "intermediate_size": 24,
    "num_attention_heads": 2, "num_hidden_layers": 2, "vocab_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 8})");
  ASSERT_FALSE(q3.ok());
  EXPECT_NE(q3.status().message().find("q/k RMSNorm"), std::string::npos) << q3.status().message();
}

TEST(MoeConfigTest, QwenFieldsParse) {
  const nlohmann::json j = nlohmann::json::parse(R"({"num_experts": 6, "num_experts_per_tok": 2,
    "moe_intermediate_size": 8, "shared_expert_intermediate_size": 20, "norm_topk_prob": false,
    "decoder_sparse_step": 2, "mlp_only_layers": [3], "router_aux_loss_coef": 0.001})");
  auto m = MoeConfig::from_json(j, MoeFamily::kQwen2);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->shared_expert_intermediate_size, 20);
  EXPECT_FALSE(m->norm_topk_prob);
  // Layer i is sparse iff i is not in mlp_only_layers and (i + 1) % step == 0.
  std::vector<bool> sparse;
  for (int l = 0; l < 6; ++l) sparse.push_back(m->is_sparse_layer(l));
  EXPECT_EQ(sparse, (std::vector<bool>{false, true, false, false, false, true}));
  EXPECT_TRUE(m->validate(6).ok());
  EXPECT_FALSE(m->validate(3).ok());  // layer 3 does not exist
  auto q3 = MoeConfig::from_json(j, MoeFamily::kQwen3);
  ASSERT_FALSE(q3.ok());
  EXPECT_NE(q3.status().message().find("shared_expert_intermediate_size"), std::string::npos);
}

// ---- against the independent PyTorch implementation (scripts/torch_reference.py) ----

// `foldpar verify --dump` of a model built here (Qwen2-MoE's config does not load yet: its
// q/k/v biases are refused), then the oracle's float64 loss, logits and every gradient.
TEST(MoeTorchOracle, Qwen2MoeLikeModelMatchesHuggingFaceRouting) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 has no torch (scripts/setup.sh installs python3-torch)";
  std::vector<std::string> dirs;
  for (MoeFamily family : {MoeFamily::kQwen2, MoeFamily::kQwen3}) {
    VerifyOptions o;
    o.config = moe_config(family);
    o.config.hidden_size = 16;
    o.config.vocab_size = 40;
    o.config.moe.num_experts = 5;
    o.config.moe.num_experts_per_tok = 3;
    o.seed = 7;
    o.batch = 2;
    o.seq = 12;
    const std::string dir = ::testing::TempDir() + "moe_oracle_" + std::to_string(static_cast<int>(family)) + "_" +
                            std::to_string(getpid());  // two checkouts' suites may run at once
    std::filesystem::remove_all(dir);
    o.dump_dir = dir;
    Result<VerifyReport> r = run_verify(o);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_TRUE(r->passed) << r->worst_name << " " << r->worst;
    dirs.push_back(dir);
  }
  // Both dumps in one process (tests/e2e/torch_oracle_many.py: torch_reference.main on each),
  // so torch is imported once.
  std::string cmd = std::string("/usr/bin/python3 ") + FOLDPAR_SOURCE_DIR + "/tests/e2e/torch_oracle_many.py " +
                    FOLDPAR_SOURCE_DIR;
  for (const std::string& d : dirs) cmd += " " + d;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (const std::string& d : dirs) std::filesystem::remove_all(d);
}

// ---- export and import of the per-expert tensors ----

TEST(MoeCheckpoint, MixtralExportThenImportRoundTripsBitForBit) {
  auto c = LlamaConfig::from_json(mixtral_json(R"(, "router_aux_loss_coef": 0.02)"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  LlamaWeights w = LlamaWeights::allocate(*c, DType::kF32, MemCategory::kParameters);
  init_weights(InitOptions{.seed = 4, .std = 0.3, .norm_jitter = 0.1}, w);
  const std::string dir = ::testing::TempDir() + "moe_export_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(write_hf_directory(dir, *c, w).ok());
  LlamaWeights back = LlamaWeights::allocate(*c, DType::kF32, MemCategory::kParameters);
  back.zero();
  std::vector<ParamRef> params;
  back.for_each([&](const std::string& name, Tensor& t) {
    ParamRef p;
    p.name = name;
    p.param = t;
    p.slices.push_back(GlobalSlice{name, 0, t.numel() / t.dim(-1), 0, t.dim(-1)});
    params.push_back(std::move(p));
  });
  const Status st = load_hf_weights(dir, *c, params);
  ASSERT_TRUE(st.ok()) << st.to_string();
  std::vector<Tensor> want;
  int64_t experts_seen = 0;
  w.for_each([&](const std::string& name, const Tensor& t) {
    want.push_back(t);
    experts_seen += name.find("block_sparse_moe.experts.") != std::string::npos ? 1 : 0;
  });
  EXPECT_EQ(experts_seen, 2 * 4 * 3);  // layers x experts x (w1, w2, w3)
  size_t i = 0;
  back.for_each([&](const std::string& name, const Tensor& t) {
    EXPECT_EQ(std::memcmp(t.raw_data(), want[i].raw_data(), t.nbytes()), 0) << name;
    ++i;
  });
  std::filesystem::remove_all(dir);
}

// What a pipeline stage hands the next (parallel/pipeline/): the statistics packed per sparse
// layer as E counts, E probability sums, the rows and the dropped pairs, the layers not yet
// recorded zero; a
// stage that takes them and records its own layer gives the loss and gradient of all
// layers recorded in one MoeAux.
TEST(MoeAux, PackedStatisticsCarryEveryRecordedLayer) {
  MoeAux first(3, 2), both(3, 2);
  first.counts[0] = {4, 1, 1};
  first.prob_sums[0] = {2.5, 1.25, 2.25};
  first.rows[0] = 3;
  first.dropped[0] = 2;
  const std::vector<double> packed = first.pack();
  ASSERT_EQ(static_cast<int64_t>(packed.size()), first.packed_size());
  EXPECT_EQ(packed, (std::vector<double>{4, 1, 1, 2.5, 1.25, 2.25, 3, 2, 0, 0, 0, 0, 0, 0, 0, 0}));
  MoeAux next(3, 2);
  next.unpack(packed);
  next.counts[1] = {0, 3, 3};
  next.prob_sums[1] = {1.0, 2.5, 2.5};
  next.rows[1] = 3;
  next.dropped[1] = 1;
  both.counts = {{4, 1, 1}, {0, 3, 3}};
  both.prob_sums = {{2.5, 1.25, 2.25}, {1.0, 2.5, 2.5}};
  both.rows = {3, 3};
  for (bool per_layer : {false, true}) {
    EXPECT_EQ(next.loss(per_layer), both.loss(per_layer));
    EXPECT_EQ(next.prob_grad(0.5, per_layer), both.prob_grad(0.5, per_layer));
    EXPECT_EQ(next.unflatten(MoeAux::flatten(next.prob_grad(0.5, per_layer))), both.prob_grad(0.5, per_layer));
  }
  EXPECT_EQ(next.load(), (std::vector<int64_t>{4, 4, 4}));
  EXPECT_EQ(next.dropped_pairs(), 3);
  // The loss needs both stages' layers: the first stage's alone gives another.
  EXPECT_NE(first.loss(false), both.loss(false));
}

}  // namespace
}  // namespace foldpar
