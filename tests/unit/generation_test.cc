// Generation's single-rank pieces: the sampler (greedy, temperature, top-k, top-p; counter-
// based draws) and CompletionText (stop sequences, the held-back streaming tail).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "infer/completion_text.h"
#include "infer/sampler.h"

namespace foldpar {
namespace {

TEST(Sampler, GreedyIsTheArgmaxLowestIdOnTies) {
  const std::vector<float> logits{0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(sample_token(logits, SamplingOptions{}, 0, 0), 1);
  // top_k = 1 is greedy at any temperature.
  EXPECT_EQ(sample_token(logits, SamplingOptions{.temperature = 5, .top_k = 1}, 3, 7), 1);
}

// Frequencies of 40000 draws (sequence 0, steps 0..N-1).
std::vector<double> frequencies(const std::vector<float>& logits, const SamplingOptions& o) {
  const int n = 40000;
  std::vector<double> f(logits.size(), 0);
  for (int s = 0; s < n; ++s) f[static_cast<size_t>(sample_token(logits, o, 0, static_cast<uint64_t>(s)))] += 1.0 / n;
  return f;
}

// Standard error of a frequency near 0.5 over 40000 draws is 0.0025; 0.012 is ~5 sigma.
constexpr double kFrequencyTolerance = 0.012;

TEST(Sampler, TemperatureOneFollowsTheSoftmax) {
  const std::vector<float> logits{std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  const std::vector<double> f = frequencies(logits, SamplingOptions{.temperature = 1, .seed = 1});
  EXPECT_NEAR(f[0], 0.5, kFrequencyTolerance);
  EXPECT_NEAR(f[1], 0.3, kFrequencyTolerance);
  EXPECT_NEAR(f[2], 0.2, kFrequencyTolerance);
}

TEST(Sampler, TemperatureSharpensAndFlattens) {
  const std::vector<float> logits{std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  // T = 0.5 squares the probabilities: 0.25, 0.09, 0.04 over 0.38.
  const std::vector<double> f = frequencies(logits, SamplingOptions{.temperature = 0.5, .seed = 2});
  EXPECT_NEAR(f[0], 0.25 / 0.38, kFrequencyTolerance);
  EXPECT_NEAR(f[2], 0.04 / 0.38, kFrequencyTolerance);
  // A large temperature is nearly uniform.
  const std::vector<double> u = frequencies(logits, SamplingOptions{.temperature = 1000, .seed = 3});
  for (double x : u) EXPECT_NEAR(x, 1.0 / 3, kFrequencyTolerance);
}

TEST(Sampler, TopKAndTopPCutTheTail) {
  const std::vector<float> logits{std::log(0.1f), std::log(0.5f), std::log(0.15f), std::log(0.25f)};
  // top_k = 2: tokens 1 and 3 only, renormalized 0.5/0.75 and 0.25/0.75.
  std::vector<double> f = frequencies(logits, SamplingOptions{.temperature = 1, .top_k = 2, .seed = 4});
  EXPECT_EQ(f[0] + f[2], 0.0);
  EXPECT_NEAR(f[1], 2.0 / 3, kFrequencyTolerance);
  // top_p = 0.7: 0.5 + 0.25 reaches it, so again tokens 1 and 3.
  f = frequencies(logits, SamplingOptions{.temperature = 1, .top_p = 0.7, .seed = 5});
  EXPECT_EQ(f[0] + f[2], 0.0);
  EXPECT_NEAR(f[3], 1.0 / 3, kFrequencyTolerance);
  // top_p = 0.45: the first token alone reaches it.
  f = frequencies(logits, SamplingOptions{.temperature = 1, .top_p = 0.45, .seed = 6});
  EXPECT_EQ(f[0] + f[2] + f[3], 0.0);
}

TEST(Sampler, DrawsAreKeyedBySeedSequenceAndStep) {
  std::vector<float> logits(50);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(std::sin(static_cast<double>(i)));
  const SamplingOptions o{.temperature = 1, .seed = 9};
  int same_seed = 0, other_seed = 0, other_sequence = 0;
  SamplingOptions o2 = o;
  o2.seed = 10;
  for (uint64_t s = 0; s < 200; ++s) {
    same_seed += sample_token(logits, o, 4, s) == sample_token(logits, o, 4, s);
    other_seed += sample_token(logits, o, 4, s) == sample_token(logits, o2, 4, s);
    other_sequence += sample_token(logits, o, 4, s) == sample_token(logits, o, 5, s);
  }
  EXPECT_EQ(same_seed, 200);
  EXPECT_LT(other_seed, 60);  // ~ sum p_i^2 of 200 (about 0.04 here): far below 60
  EXPECT_LT(other_sequence, 60);
}

TEST(Sampler, InvalidOptionsNameTheValue) {
  EXPECT_NE(SamplingOptions{.temperature = -1}.validate().to_string().find("--temperature (-1)"), std::string::npos);
  EXPECT_NE(SamplingOptions{.top_k = -2}.validate().to_string().find("--top-k (-2)"), std::string::npos);
  EXPECT_NE(SamplingOptions{.top_p = 0}.validate().to_string().find("--top-p (0)"), std::string::npos);
  EXPECT_NE(SamplingOptions{.top_p = 1.5}.validate().to_string().find("--top-p (1.5)"), std::string::npos);
  const SamplingOptions good{.temperature = 0.7, .top_k = 40, .top_p = 0.9};
  EXPECT_TRUE(good.validate().ok());
}

std::vector<int32_t> bytes_of(const std::string& s) { return std::vector<int32_t>(s.begin(), s.end()); }

TEST(CompletionText, StopsAtTheEarliestStopSequenceAndCutsIt) {
  auto tok = make_byte_tokenizer();
  CompletionText t(*tok, {"\n\n", "END"});
  std::string streamed;
  bool stopped = false;
  for (int32_t id : bytes_of("one\ntwo END three")) {
    stopped = t.add(id);
    streamed += t.take_ready(stopped);
    if (stopped) break;
  }
  EXPECT_TRUE(stopped);
  EXPECT_EQ(t.text(), "one\ntwo ");
  EXPECT_EQ(streamed, "one\ntwo ");
  EXPECT_EQ(t.tokens().size(), std::string("one\ntwo END").size());
}

TEST(CompletionText, HoldsBackOnlyWhatCouldStartAStop) {
  auto tok = make_byte_tokenizer();
  CompletionText t(*tok, {"STOP"});
  for (int32_t id : bytes_of("abcST")) t.add(id);
  EXPECT_EQ(t.take_ready(false), "abc");  // "ST" may begin "STOP"
  t.add('x');
  EXPECT_EQ(t.take_ready(false), "STx");  // it did not
  t.add('S');
  EXPECT_EQ(t.take_ready(false), "");
  EXPECT_EQ(t.take_ready(true), "S");     // the end releases everything
  EXPECT_FALSE(t.stopped());
}

TEST(CompletionText, WithoutStopsEverythingIsReadyAtOnce) {
  auto tok = make_byte_tokenizer();
  CompletionText t(*tok, {""});  // empty stop strings are ignored
  for (int32_t id : bytes_of("hello")) EXPECT_FALSE(t.add(id));
  EXPECT_EQ(t.take_ready(false), "hello");
}

}  // namespace
}  // namespace foldpar
