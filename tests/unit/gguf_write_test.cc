// GGUF export pieces: f16 rounding against the compiler's _Float16 conversion, the RoPE row
// order (rotating HF pairs of the original rows equals rotating adjacent pairs of the
// reordered rows, for every position), and the byte-level stand-ins of the byte tokenizer.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <set>

#include "checkpoint/gguf_export.h"
#include "io/gguf_write.h"
#include "test_util.h"

namespace foldpar {
namespace {

uint16_t reference_f16(float x) { return std::bit_cast<uint16_t>(static_cast<_Float16>(x)); }

TEST(GgufWrite, F16RoundingMatchesTheCompilersConversion) {
  int64_t checked = 0;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4093) {  // a stride coprime to every field width
    const float x = std::bit_cast<float>(static_cast<uint32_t>(u));
    const uint16_t want = reference_f16(x), got = f32_to_f16_bits(x);
    if (std::isnan(x)) {
      ASSERT_EQ(got & 0x7c00u, 0x7c00u) << u;
      ASSERT_NE(got & 0x03ffu, 0u) << u;
    } else {
      ASSERT_EQ(got, want) << "f32 bits " << std::hex << u << ": got " << got << ", want " << want;
    }
    ++checked;
  }
  EXPECT_GT(checked, 1000000);
  // The boundaries: halfway cases, the largest half, overflow, subnormals, zeros.
  for (float x : {65504.0f, 65519.996f, 65520.0f, 1e-8f, 5.96046448e-8f, 2.98023224e-8f, 2.98023259e-8f, 6.1035156e-5f,
                  6.1028e-5f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, -0.0f, 0.0f, INFINITY, -INFINITY})
    EXPECT_EQ(f32_to_f16_bits(x), reference_f16(x)) << x;
}

// Rotates x (d values) at `pos`: HF pairs (i, i + d/2) or adjacent pairs (2i, 2i + 1).
std::vector<double> rotate(const std::vector<double>& x, int64_t pos, bool adjacent) {
  const int64_t d = static_cast<int64_t>(x.size()), half = d / 2;
  std::vector<double> y(x.size());
  for (int64_t i = 0; i < half; ++i) {
    const double a = pos * std::pow(10000.0, -2.0 * i / d), c = std::cos(a), s = std::sin(a);
    const int64_t p = adjacent ? 2 * i : i, q = adjacent ? 2 * i + 1 : i + half;
    y[p] = x[p] * c - x[q] * s;
    y[q] = x[q] * c + x[p] * s;
  }
  return y;
}

TEST(GgufWrite, ReorderedRowsGiveTheSameScoresUnderAdjacentPairRope) {
  const int64_t n_heads = 3, d = 8, h = 5;
  const Tensor wq = testing::random_tensor({n_heads * d, h}, DType::kF32, 1);
  const Tensor wk = testing::random_tensor({n_heads * d, h}, DType::kF32, 2);
  const std::vector<float> pq = permute_rows_for_gguf_rope(wq, n_heads, d), pk = permute_rows_for_gguf_rope(wk, n_heads, d);
  const Tensor x = testing::random_tensor({h}, DType::kF32, 3), y = testing::random_tensor({h}, DType::kF32, 4);
  auto project = [&](const float* w, const Tensor& v, int64_t head) {
    std::vector<double> out(d);
    for (int64_t r = 0; r < d; ++r)
      for (int64_t c = 0; c < h; ++c) out[r] += double(w[(head * d + r) * h + c]) * v.data<float>()[c];
    return out;
  };
  auto dot = [](const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
  };
  for (int64_t head = 0; head < n_heads; ++head)
    for (int64_t pq_pos : {0, 3, 17})
      for (int64_t pk_pos : {0, 5}) {
        const double hf = dot(rotate(project(wq.data<float>(), x, head), pq_pos, false),
                              rotate(project(wk.data<float>(), y, head), pk_pos, false));
        const double gguf = dot(rotate(project(pq.data(), x, head), pq_pos, true), rotate(project(pk.data(), y, head), pk_pos, true));
        EXPECT_NEAR(hf, gguf, 1e-9 * (1 + std::abs(hf))) << "head " << head << " positions " << pq_pos << ", " << pk_pos;
      }
}

// A q or k bias [n_heads * d] moves with its weight's rows (the llama architecture): element
// j d/2 + i of a head goes to 2i + j, as a one-column weight's row would.
TEST(GgufWrite, BiasEntriesFollowTheirRows) {
  const int64_t n_heads = 2, d = 6, h = 3;
  const Tensor w = testing::random_tensor({n_heads * d, h}, DType::kF32, 5);
  Tensor b = Tensor::empty({n_heads * d}, DType::kF32, MemCategory::kWorkspace);
  for (int64_t r = 0; r < n_heads * d; ++r) b.data<float>()[r] = w.data<float>()[r * h];  // column 0
  const std::vector<float> pw = permute_rows_for_gguf_rope(w, n_heads, d), pb = permute_rows_for_gguf_rope(b, n_heads, d);
  ASSERT_EQ(pb.size(), static_cast<size_t>(n_heads * d));
  for (int64_t r = 0; r < n_heads * d; ++r) EXPECT_EQ(pb[r], pw[r * h]) << "row " << r;
  EXPECT_EQ(pb[2], b.data<float>()[1]);          // file row 2i + j = 2 (i 1, j 0): HF row j d/2 + i = 1
  EXPECT_EQ(pb[3], b.data<float>()[d / 2 + 1]);  // file row 3 (i 1, j 1): HF row d/2 + 1
}

TEST(GgufWrite, ByteTokenizerVocabularyIsDistinctPrintableAndPadded) {
  Result<GgufVocab> v = byte_tokenizer_vocab(300);
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(v->model, "gpt2");
  ASSERT_EQ(v->tokens.size(), 300u);
  EXPECT_EQ(std::set<std::string>(v->tokens.begin(), v->tokens.end()).size(), 300u);
  EXPECT_EQ(v->tokens['A'], "A");
  EXPECT_EQ(v->tokens[' '], "\xc4\xa0");   // U+0120, GPT-2's stand-in for a space
  EXPECT_EQ(v->tokens['\n'], "\xc4\x8a");  // U+010A
  EXPECT_EQ(v->tokens[0xff], "\xc3\xbf");  // printable: itself
  EXPECT_EQ(v->token_types[299], 5);
  EXPECT_EQ(v->eos_id, 256);
  EXPECT_FALSE(byte_tokenizer_vocab(255).ok());
}

}  // namespace
}  // namespace foldpar
