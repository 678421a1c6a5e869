// RoPE tables with Hugging Face's rope_scaling types: precision at long positions and large
// theta against a long-double computation, each type's defining properties, and config.json
// parsing (refusals by name, round trip). The formulas themselves are checked against
// PyTorch (scripts/torch_reference.py) end to end by e2e.rope_scaling_oracle.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "backend/rope_table.h"
#include "model/llama_config.h"

namespace foldpar {
namespace {

using Type = RopeScaling::Type;

std::vector<float> table_values(std::span<const int32_t> positions, const RopeSpec& spec, int64_t seq_len) {
  auto be = make_reference_backend();
  const Tensor t = build_rope_table(*be, positions, spec, seq_len, DType::kF32);
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

RopeSpec spec_of(int64_t d, double theta, int64_t max_pos, RopeScaling s = {}) {
  return RopeSpec{d, theta, max_pos, s};
}

// rope_theta in the millions, positions to 1M tokens: every cos/sin within f32 rounding of
// the long-double value (f32 angles, as torch forms them, are off by up to ~0.06 rad there).
TEST(RopeTable, PrecisionAtMillionPositionsAndLargeTheta) {
  const std::vector<int32_t> pos = {0, 1, 4095, 131071, 524287, 999999, 1000000, 1048575};
  for (double theta : {5e5, 1e6, 5e6}) {
    const int64_t d = 128, half = d / 2;
    const std::vector<float> got = table_values(pos, spec_of(d, theta, 131072), 0);
    double worst = 0;
    for (size_t p = 0; p < pos.size(); ++p)
      for (int64_t i = 0; i < half; ++i) {
        const long double inv = 1.0L / std::pow(static_cast<long double>(theta), 2.0L * i / d);
        const long double angle = static_cast<long double>(pos[p]) * inv;
        worst = std::max(worst, static_cast<double>(std::fabs(got[(p * 2) * half + i] - std::cos(angle))));
        worst = std::max(worst, static_cast<double>(std::fabs(got[(p * 2 + 1) * half + i] - std::sin(angle))));
      }
    EXPECT_LT(worst, 1.2e-7) << "theta " << theta;
  }
}

TEST(RopeScaling, LinearDividesEveryFrequency) {
  RopeScaling s;
  s.type = Type::kLinear;
  s.factor = 4;
  const RopeFrequencies plain = rope_frequencies(spec_of(64, 1e4, 4096), 0);
  const RopeFrequencies lin = rope_frequencies(spec_of(64, 1e4, 4096, s), 0);
  ASSERT_EQ(lin.inv_freq.size(), 32u);
  for (size_t i = 0; i < 32; ++i) EXPECT_DOUBLE_EQ(lin.inv_freq[i], plain.inv_freq[i] / 4);
  EXPECT_EQ(lin.attention_factor, 1.0);
}

// Llama 3.2's values: wavelengths below 8192/4 kept, above 8192/1 divided by 32, between
// interpolated (monotone in the wavelength, strictly between the two).
TEST(RopeScaling, Llama3BandsOfWavelength) {
  RopeScaling s;
  s.type = Type::kLlama3;
  s.factor = 32;
  s.low_freq_factor = 1;
  s.high_freq_factor = 4;
  s.original_max_position_embeddings = 8192;
  const RopeFrequencies plain = rope_frequencies(spec_of(64, 5e5, 131072), 0);
  const RopeFrequencies l3 = rope_frequencies(spec_of(64, 5e5, 131072, s), 0);
  int kept = 0, divided = 0, between = 0;
  for (size_t i = 0; i < plain.inv_freq.size(); ++i) {
    const double wavelen = 2 * std::numbers::pi / plain.inv_freq[i];
    if (wavelen < 8192.0 / 4) {
      EXPECT_EQ(l3.inv_freq[i], plain.inv_freq[i]);
      ++kept;
    } else if (wavelen > 8192.0) {
      EXPECT_DOUBLE_EQ(l3.inv_freq[i], plain.inv_freq[i] / 32);
      ++divided;
    } else {
      EXPECT_LT(l3.inv_freq[i], plain.inv_freq[i]);
      EXPECT_GT(l3.inv_freq[i], plain.inv_freq[i] / 32);
      ++between;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(between, 0);
}

// Yarn: high frequencies extrapolated (unchanged), low ones interpolated (/ factor), and
// cos^2 + sin^2 = attention_factor^2 with the default 0.1 ln(factor) + 1.
TEST(RopeScaling, YarnRampAndAttentionFactor) {
  RopeScaling s;
  s.type = Type::kYarn;
  s.factor = 4;
  s.original_max_position_embeddings = 32768;
  const RopeSpec spec = spec_of(128, 1e6, 131072, s);
  const RopeFrequencies plain = rope_frequencies(spec_of(128, 1e6, 131072), 0);
  const RopeFrequencies y = rope_frequencies(spec, 0);
  EXPECT_DOUBLE_EQ(y.attention_factor, 0.1 * std::log(4.0) + 1.0);
  EXPECT_EQ(y.inv_freq.front(), plain.inv_freq.front());
  EXPECT_DOUBLE_EQ(y.inv_freq.back(), plain.inv_freq.back() / 4);
  const std::vector<int32_t> pos = {0, 7, 100000};
  const std::vector<float> t = table_values(pos, spec, 0);
  for (size_t p = 0; p < pos.size(); ++p)
    for (int64_t i = 0; i < 64; ++i) {
      const double c = t[(p * 2) * 64 + i], sn = t[(p * 2 + 1) * 64 + i];
      EXPECT_NEAR(std::sqrt(c * c + sn * sn), y.attention_factor, 1e-6);
    }
  s.attention_factor = 1.5;
  EXPECT_EQ(rope_frequencies(spec_of(128, 1e6, 131072, s), 0).attention_factor, 1.5);
  s.attention_factor = 0;
  s.mscale = 1;
  s.mscale_all_dim = 1;  // DeepSeek's ratio: 1
  EXPECT_DOUBLE_EQ(rope_frequencies(spec_of(128, 1e6, 131072, s), 0).attention_factor, 1.0);
}

// Dynamic NTK: unscaled up to max_position_embeddings, then theta grows with the length.
TEST(RopeScaling, DynamicRescalesOnlyBeyondMaxPositions) {
  RopeScaling s;
  s.type = Type::kDynamic;
  s.factor = 2;
  const RopeFrequencies plain = rope_frequencies(spec_of(64, 1e4, 1024), 0);
  const RopeFrequencies short_seq = rope_frequencies(spec_of(64, 1e4, 1024, s), 1024);
  for (size_t i = 0; i < 32; ++i) EXPECT_DOUBLE_EQ(short_seq.inv_freq[i], plain.inv_freq[i]);
  const RopeFrequencies long_seq = rope_frequencies(spec_of(64, 1e4, 1024, s), 4096);
  const double base = 1e4 * std::pow(2.0 * 4096 / 1024 - 1, 64.0 / 62.0);
  for (size_t i = 0; i < 32; ++i) EXPECT_DOUBLE_EQ(long_seq.inv_freq[i], 1.0 / std::pow(base, 2.0 * i / 64));
}

std::string config_with(const std::string& rope_scaling) {
  return R"({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 1,
             "vocab_size": 32, "max_position_embeddings": 256, "rope_scaling": )" +
         rope_scaling + "}";
}

TEST(RopeScalingConfig, ReadsEachTypeAndRoundTrips) {
  for (const char* rs : {R"({"rope_type": "linear", "factor": 2.0})", R"({"type": "dynamic", "factor": 3})",
                         R"({"rope_type": "llama3", "factor": 32, "low_freq_factor": 1, "high_freq_factor": 4,
                             "original_max_position_embeddings": 64})",
                         R"({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                             "beta_fast": 16, "attention_factor": 1.2})"}) {
    Result<LlamaConfig> c = LlamaConfig::from_json(config_with(rs));
    ASSERT_TRUE(c.ok()) << c.status().message();
    EXPECT_TRUE(c->rope_scaling.enabled());
    Result<LlamaConfig> back = LlamaConfig::from_json(c->to_json());
    ASSERT_TRUE(back.ok()) << back.status().message();
    const RopeFrequencies a = rope_frequencies(c->rope_spec(), 1000), b = rope_frequencies(back->rope_spec(), 1000);
    EXPECT_EQ(a.inv_freq, b.inv_freq) << rs;
    EXPECT_EQ(a.attention_factor, b.attention_factor) << rs;
  }
  Result<LlamaConfig> c = LlamaConfig::from_json(config_with(R"({"rope_type": "default"})"));
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->rope_scaling.enabled());
}

TEST(RopeScalingConfig, RefusesByName) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"rope_type": "longrope", "factor": 2})", "rope_scaling type \"longrope\" is not supported"},
      {R"({"rope_type": "linear", "factor": 2, "mrope_section": [1]})", "field \"mrope_section\" is not supported"},
      {R"({"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "original_max_position_embeddings": 64})",
       "missing \"high_freq_factor\""},
      {R"({"rope_type": "linear"})", "missing \"factor\""},
      {R"({"rope_type": "yarn", "factor": -1})", "factor (-1) must be positive"},
      {R"({"factor": 2})", "no \"rope_type\""},
      {R"("linear")", "must be an object or null"},
  };
  for (const auto& [rs, words] : cases) {
    Result<LlamaConfig> c = LlamaConfig::from_json(config_with(rs));
    ASSERT_FALSE(c.ok()) << rs;
    EXPECT_NE(c.status().message().find(words), std::string::npos) << c.status().message();
  }
}

}  // namespace
}  // namespace foldpar
