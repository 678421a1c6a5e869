// The single-rank model: fast backend against the reference backend (loss, logits, every
// gradient), recomputation and determinism, memory accounting, config and batch errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "core/tolerance.h"
#include "core/rng.h"
#include "model/init_values.h"
#include "model/llama_model.h"
#include "test_util.h"

#ifndef FOLDPAR_SOURCE_DIR
#define FOLDPAR_SOURCE_DIR "."
#endif

namespace foldpar {
namespace {

using testing::near_rel;

LlamaConfig load_config(const char* name) {
  Result<LlamaConfig> c = LlamaConfig::load(std::string(FOLDPAR_SOURCE_DIR) + "/configs/" + name);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.value();
}

Batch random_batch(const LlamaConfig& c, int64_t B, int64_t S, uint64_t seed) {
  Batch b;
  b.input_ids = Tensor::empty({B, S}, DType::kI32, MemCategory::kActivations);
  b.target_ids = Tensor::empty({B, S}, DType::kI32, MemCategory::kActivations);
  Rng rng(seed);
  for (int64_t i = 0; i < B * S; ++i) {
    b.input_ids.data<int32_t>()[i] = static_cast<int32_t>(rng.below(c.vocab_size));
    b.target_ids.data<int32_t>()[i] = i % 7 == 3 ? kIgnoreIndex : static_cast<int32_t>(rng.below(c.vocab_size));
  }
  return b;
}

struct StepRun {
  StepResult result;
  LlamaWeights grads;
};

StepRun run_step(const LlamaConfig& c, Backend& be, const LlamaWeights& w, const Batch& batch, Recompute rc) {
  StepRun run{{}, LlamaWeights::allocate(c, w.embed.dtype(), MemCategory::kGradients)};
  run.grads.zero();
  StepOptions opts;
  opts.recompute = rc;
  opts.keep_logits = true;
  Result<StepResult> r = model_forward_backward(c, be, w, batch, opts, run.grads);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  run.result = std::move(r).value();
  return run;
}

class ModelParity : public ::testing::TestWithParam<bool> {};

TEST_P(ModelParity, FastMatchesReferenceOnTinyConfig) {
  LlamaConfig c = load_config("tiny.json");
  c.tie_word_embeddings = GetParam();
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(InitOptions{.seed = 11, .std = 0.1, .norm_jitter = 0.2}, w);
  const Batch batch = random_batch(c, 2, 67, 5);  // S not a multiple of any block size
  auto fast = make_cpu_backend();
  auto ref = make_reference_backend();
  StepRun a = run_step(c, *fast, w, batch, Recompute::kNone);
  StepRun b = run_step(c, *ref, w, batch, Recompute::kNone);
  EXPECT_NEAR(a.result.loss, b.result.loss, tol::kF32Model * b.result.loss);
  EXPECT_EQ(a.result.valid_tokens, b.result.valid_tokens);
  EXPECT_TRUE(near_rel(a.result.logits, b.result.logits, tol::kF32Model));
  std::vector<Tensor> ga, gb;
  a.grads.for_each([&](const std::string&, Tensor& t) { ga.push_back(t); });
  b.grads.for_each([&](const std::string& name, Tensor& t) {
    gb.push_back(t);
    EXPECT_TRUE(near_rel(ga[gb.size() - 1], t, tol::kF32Model)) << name;
  });
}

INSTANTIATE_TEST_SUITE_P(Tied, ModelParity, ::testing::Bool());

TEST(Model, RecomputeAndRepeatAreBitwiseIdentical) {
  const LlamaConfig c = load_config("tiny.json");
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(InitOptions{.seed = 1}, w);
  const Batch batch = random_batch(c, 1, 40, 9);
  auto be = make_cpu_backend();
  StepRun a = run_step(c, *be, w, batch, Recompute::kNone);
  StepRun b = run_step(c, *be, w, batch, Recompute::kBlock);
  StepRun a2 = run_step(c, *be, w, batch, Recompute::kNone);
  EXPECT_EQ(a.result.loss, b.result.loss);
  EXPECT_EQ(a.result.loss, a2.result.loss);
  std::vector<Tensor> ga, ga2;
  a.grads.for_each([&](const std::string&, Tensor& t) { ga.push_back(t); });
  a2.grads.for_each([&](const std::string&, Tensor& t) { ga2.push_back(t); });
  size_t i = 0;
  b.grads.for_each([&](const std::string& name, Tensor& t) {
    EXPECT_EQ(max_rel_error(t, ga[i]), 0.0) << name;
    EXPECT_EQ(max_rel_error(ga2[i], ga[i]), 0.0) << name;
    ++i;
  });
}

TEST(Model, RecomputeLowersTheActivationPeak) {
  const LlamaConfig c = load_config("tiny.json");
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(InitOptions{.seed = 1}, w);
  const Batch batch = random_batch(c, 1, 256, 9);
  auto be = make_cpu_backend();
  auto peak_of = [&](Recompute rc) {
    LlamaWeights g = LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients);
    g.zero();
    MemoryTracker::process().reset_peaks();
    const int64_t before = MemoryTracker::process().stats().current_of(MemCategory::kActivations);
    StepOptions o;
    o.recompute = rc;
    EXPECT_TRUE(model_forward_backward(c, *be, w, batch, o, g).ok());
    const MemoryStats s = MemoryTracker::process().stats();
    EXPECT_EQ(s.current_of(MemCategory::kActivations), before);  // nothing leaks past the step
    return s.peak_of(MemCategory::kActivations) - before;
  };
  const int64_t keep = peak_of(Recompute::kNone), recompute = peak_of(Recompute::kBlock);
  // Kept activations per layer are ~ (7h + 3f + 2 kv) floats per token; recomputation keeps
  // one h per layer plus one block's set: well under half with 2 layers of f = 3h.
  EXPECT_LT(recompute * 10, keep * 8) << "keep " << keep << " recompute " << recompute;
  const int64_t T = 256, h = c.hidden_size;
  EXPECT_GT(keep, c.num_hidden_layers * T * h * 4 * 7);  // at least the block's own h-sized tensors
}

// The initialization contract every layout's shards rely on, from its primitives: element i
// of tensor `name` is std x normal_at(seed, stream_id(name), i), or 1 + norm_jitter x that for
// a norm gain, rounded once. InitValues (the loops' form, inlined in several translation
// units) and init_value give it bit for bit.
TEST(Model, InitValuesAreTheCounterBasedNormals) {
  const InitOptions o{.seed = 42, .std = 0.03, .norm_jitter = 0.2};
  for (const std::string name : {"model.layers.3.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight",
                                 "model.norm.weight", "model.embed_tokens.weight"}) {
    const bool norm = name.ends_with("norm.weight");
    const InitValues values(o, name);
    for (int64_t i : {int64_t{0}, int64_t{1}, int64_t{977}, int64_t{1} << 33}) {
      const double z = normal_at(42, stream_id(name), static_cast<uint64_t>(i));
      const double want = norm ? std::fma(0.2, z, 1.0) : 0.03 * z;
      EXPECT_EQ(values.at(i), want) << name << " " << i;
      EXPECT_EQ(init_value(o, name, i), want) << name << " " << i;
    }
  }
}

TEST(Model, ParameterCounts) {
  EXPECT_EQ(load_config("tiny.json").parameter_count(), 256 * 64 * 2 + 64 + 2 * (2 * 64 + 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 192));
  const int64_t small = load_config("small.json").parameter_count();
  EXPECT_GE(small, 10'000'000);
  EXPECT_LE(small, 20'000'000);
  const LlamaConfig big = load_config("paper-7b.json");
  EXPECT_EQ(big.hidden_size, 4096);
  EXPECT_EQ(big.num_hidden_layers * 16 * big.hidden_size * big.hidden_size + 2 * 32000 * 4096 + 4096 * 65,
            big.parameter_count());
  // Allocation matches the count.
  const LlamaConfig c = load_config("tiny.json");
  MemoryTracker::process().reset_peaks();
  const int64_t before = MemoryTracker::process().stats().current_of(MemCategory::kParameters);
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  EXPECT_EQ(MemoryTracker::process().stats().current_of(MemCategory::kParameters) - before,
            c.parameter_count() * 4);
}

TEST(Config, RejectsBadInputWithNamedValues) {
  auto err = [](const std::string& json) { return LlamaConfig::from_json(json).status().message(); };
  const std::string base =
      R"("intermediate_size": 8, "num_hidden_layers": 1, "vocab_size": 10, "max_position_embeddings": 16)";
  EXPECT_TRUE(LlamaConfig::from_json("{\"hidden_size\": 8, \"num_attention_heads\": 2, " + base + "}").ok());
  EXPECT_NE(err("{\"hidden_size\": 8, \"num_attention_heads\": 3, " + base + "}").find("hidden_size (8)"),
            std::string::npos);
  EXPECT_NE(err("{\"hidden_size\": 8, \"num_attention_heads\": 2, \"num_key_value_heads\": 3, " + base + "}")
                .find("num_key_value_heads (3)"),
            std::string::npos);
  EXPECT_NE(err("{\"hidden_size\": \"8\", \"num_attention_heads\": 2, " + base + "}").find("hidden_size"),
            std::string::npos);
  EXPECT_NE(err("{\"num_attention_heads\": 2, " + base + "}").find("missing \"hidden_size\""), std::string::npos);
  EXPECT_NE(err("{\"hidden_size\": -8, \"num_attention_heads\": 2, " + base + "}").find("(-8)"), std::string::npos);
  EXPECT_NE(err("{not json").find("JSON"), std::string::npos);
  EXPECT_NE(err("[1, 2]").find("object"), std::string::npos);
  EXPECT_EQ(LlamaConfig::load("/nonexistent/config.json").status().code(), StatusCode::kNotFound);
}

// A field describing an architecture foldpar does not implement is refused by name, never
// ignored; the forms that describe foldpar's own architecture load.
TEST(Config, RefusesUnimplementedArchitectureFieldsByName) {
  const std::string base = R"({"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 8,
      "num_hidden_layers": 1, "vocab_size": 10, "max_position_embeddings": 16)";
  auto load = [&](const std::string& extra) { return LlamaConfig::from_json(base + ", " + extra + "}"); };
  const std::pair<const char*, const char*> refused[] = {
      {R"("model_type": "qwen2_moe")", "model_type \"qwen2_moe\" has q/k/v biases"},
      {R"("model_type": "qwen3_moe")", "model_type \"qwen3_moe\" has per-head q/k RMSNorm"},
      {R"("model_type": "gpt2")", "model_type \"gpt2\" is not supported"},
      {R"("model_type": "mistral", "attention_bias": true)",
       "\"attention_bias\" true is not supported with model_type \"mistral\""},
      {R"("attention_bias": 1)", "\"attention_bias\" must be true or false"},
      {R"("model_type": "qwen2", "mlp_bias": true)", "\"mlp_bias\" true is not supported with model_type \"qwen2\""},
      {R"("model_type": "mistral", "mlp_bias": true, "sliding_window": null)",
       "\"mlp_bias\" true is not supported with model_type \"mistral\""},
      {R"("mlp_bias": "yes")", "\"mlp_bias\" must be true or false"},
      {R"("hidden_act": "gelu")", "hidden_act \"gelu\" is not supported"},
      {R"("sliding_window": 4)", "sliding_window 4 with model_type \"llama\" is not supported"},
      {R"("sliding_window": 4, "use_sliding_window": true)", "sliding_window 4 with model_type \"llama\""},
      {R"("model_type": "qwen2", "sliding_window": 4, "use_sliding_window": true, "max_window_layers": 0)",
       "max_window_layers 0 < num_hidden_layers 1"},
      {R"("model_type": "qwen3", "sliding_window": 4, "use_sliding_window": true,
          "layer_types": ["full_attention", "sliding_attention"])",
       "layer_types entry \"sliding_attention\" with use_sliding_window true"},
      {R"("model_type": "mistral", "sliding_window": 0)", "sliding_window (0) must be positive or null"},
      {R"("model_type": "mistral", "sliding_window": "4")", "\"sliding_window\" must be an integer or null"},
  };
  for (const auto& [extra, words] : refused) {
    Result<LlamaConfig> c = load(extra);
    ASSERT_FALSE(c.ok()) << extra;
    const bool malformed = std::string(words).find("must be") != std::string::npos;
    EXPECT_EQ(c.status().code(), malformed ? StatusCode::kInvalidArgument : StatusCode::kUnimplemented) << extra;
    EXPECT_NE(c.status().message().find(words), std::string::npos) << extra << ": " << c.status().message();
  }
  for (const char* extra : {R"("model_type": "llama")", R"("model_type": "mistral", "sliding_window": null)",
                            R"("attention_bias": false, "mlp_bias": false, "hidden_act": "silu")",
                            R"("sliding_window": 32768, "use_sliding_window": false)"})
    EXPECT_TRUE(load(extra).ok()) << extra << ": " << load(extra).status().message();
  // Llama's mlp_bias: three biases per layer (2 f + h parameters), kept by to_json.
  Result<LlamaConfig> biased = load(R"("mlp_bias": true, "attention_bias": true)");
  ASSERT_TRUE(biased.ok()) << biased.status().message();
  EXPECT_TRUE(biased->mlp_bias);
  LlamaConfig plain = *biased;
  plain.mlp_bias = false;
  EXPECT_EQ(biased->parameter_count() - plain.parameter_count(), 2 * 8 + 8);
  Result<LlamaConfig> again = LlamaConfig::from_json(biased->to_json());
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_TRUE(again->mlp_bias);
}

// The sliding window as each family's Hugging Face config defines it (issue 21): Mistral's
// default when the key is absent, null as none, Qwen's use_sliding_window switch and its
// max_window_layers (no layer at or past it: no window), and the window surviving to_json.
TEST(Config, SlidingWindowOfTheHuggingFaceFamilies) {
  const std::string base = R"({"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 8,
      "num_hidden_layers": 2, "vocab_size": 10, "max_position_embeddings": 16)";
  const std::pair<const char*, int64_t> cases[] = {
      {R"("model_type": "mistral")", 4096},
      {R"("model_type": "mistral", "sliding_window": 7)", 7},
      {R"("model_type": "mistral", "sliding_window": null)", 0},
      {R"("model_type": "llama")", 0},
      {R"("model_type": "qwen2", "sliding_window": 4, "use_sliding_window": false)", 0},
      {R"("model_type": "qwen2", "sliding_window": 4, "use_sliding_window": true, "max_window_layers": 2)", 0},
      {R"("model_type": "qwen3", "sliding_window": 4, "use_sliding_window": true)", 0},  // default 28 layers full
      {R"("model_type": "qwen2", "sliding_window": 4, "use_sliding_window": true, "max_window_layers": 0,
          "layer_types": ["full_attention", "full_attention"])", 0},
  };
  for (const auto& [extra, window] : cases) {
    Result<LlamaConfig> c = LlamaConfig::from_json(base + ", " + extra + "}");
    ASSERT_TRUE(c.ok()) << extra << ": " << c.status().message();
    EXPECT_EQ(c->sliding_window, window) << extra;
    Result<LlamaConfig> back = LlamaConfig::from_json(c->to_json());
    ASSERT_TRUE(back.ok()) << c->to_json() << ": " << back.status().message();
    EXPECT_EQ(back->sliding_window, window) << c->to_json();
    EXPECT_EQ(back->qkv_bias, c->qkv_bias) << c->to_json();
  }
}

// The attention variants each family's modeling file defines (issue 21): what each model
// type and attention_bias select, and that to_json writes a file that reads back the same.
TEST(Config, AttentionVariantsOfTheHuggingFaceFamilies) {
  const std::string base = R"({"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 8,
      "num_hidden_layers": 1, "vocab_size": 10, "max_position_embeddings": 16)";
  struct Case {
    const char* extra;
    bool qkv_bias, o_bias, qk_norm;
  };
  const Case cases[] = {
      {R"("model_type": "llama")", false, false, false},
      {R"("model_type": "llama", "attention_bias": true)", true, true, false},
      {R"("model_type": "qwen2", "attention_bias": false, "use_sliding_window": false, "sliding_window": 4096)", true,
       false, false},  // Qwen2's biases do not follow attention_bias
      {R"("model_type": "qwen3", "head_dim": 6)", false, false, true},
      {R"("model_type": "qwen3", "attention_bias": true)", true, true, true},
  };
  for (const Case& k : cases) {
    Result<LlamaConfig> c = LlamaConfig::from_json(base + ", " + k.extra + "}");
    ASSERT_TRUE(c.ok()) << k.extra << ": " << c.status().message();
    EXPECT_EQ(c->qkv_bias, k.qkv_bias) << k.extra;
    EXPECT_EQ(c->o_bias, k.o_bias) << k.extra;
    EXPECT_EQ(c->qk_norm, k.qk_norm) << k.extra;
    Result<LlamaConfig> back = LlamaConfig::from_json(c->to_json());
    ASSERT_TRUE(back.ok()) << c->to_json();
    EXPECT_EQ(back->qkv_bias, k.qkv_bias) << c->to_json();
    EXPECT_EQ(back->o_bias, k.o_bias) << c->to_json();
    EXPECT_EQ(back->qk_norm, k.qk_norm) << c->to_json();
    EXPECT_EQ(back->head_dim(), c->head_dim());
    // Biases [n_h d + 2 n_kv d (+ h)], gains 2 d per layer.
    LlamaConfig plain = *c;
    plain.qkv_bias = plain.o_bias = plain.qk_norm = false;
    EXPECT_EQ(c->parameter_count() - plain.parameter_count(),
              (k.qkv_bias ? c->q_dim() + 2 * c->kv_dim() : 0) + (k.o_bias ? 8 : 0) + (k.qk_norm ? 2 * c->head_dim() : 0));
  }
}

TEST(Config, JsonRoundTrip) {
  const LlamaConfig c = load_config("tiny.json");
  Result<LlamaConfig> back = LlamaConfig::from_json(c.to_json());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->hidden_size, c.hidden_size);
  EXPECT_EQ(back->num_key_value_heads, c.num_key_value_heads);
  EXPECT_EQ(back->rms_norm_eps, c.rms_norm_eps);
  EXPECT_EQ(back->tie_word_embeddings, c.tie_word_embeddings);
}

TEST(Model, RejectsOutOfRangeTokens) {
  const LlamaConfig c = load_config("tiny.json");
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(InitOptions{}, w);
  Batch batch = random_batch(c, 1, 4, 1);
  batch.input_ids.data<int32_t>()[2] = 256;
  auto be = make_cpu_backend();
  Result<StepResult> r = model_forward(c, *be, w, batch, {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("input id 256"), std::string::npos);
  batch.input_ids.data<int32_t>()[2] = 0;
  batch.target_ids.data<int32_t>()[1] = -5;
  EXPECT_FALSE(model_forward(c, *be, w, batch, {}).ok());
}

TEST(Model, AllTargetsIgnoredGivesZeroLossAndGradients) {
  const LlamaConfig c = load_config("tiny.json");
  LlamaWeights w = LlamaWeights::allocate(c, DType::kF32, MemCategory::kParameters);
  init_weights(InitOptions{}, w);
  Batch batch = random_batch(c, 1, 5, 1);
  for (int i = 0; i < 5; ++i) batch.target_ids.data<int32_t>()[i] = kIgnoreIndex;
  auto be = make_cpu_backend();
  StepRun r = run_step(c, *be, w, batch, Recompute::kNone);
  EXPECT_EQ(r.result.valid_tokens, 0);
  EXPECT_EQ(r.result.loss, 0.0);
  r.grads.for_each([&](const std::string& name, Tensor& t) { EXPECT_EQ(be->sum_squares(t), 0.0) << name; });
}

}  // namespace
}  // namespace foldpar
