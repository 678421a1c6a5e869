// .npy headers beyond what NumPy 1.24 writes for the e2e test (tests/e2e/pretokenized_data.sh):
// format version 2 (a 4-byte header length), a 0-d array, missing keys, a header length past
// the end, and values decoded at the edges of each width.
#include <gtest/gtest.h>

#include "data/token_stream.h"

namespace foldpar {
namespace {

std::string npy(int major, const std::string& dict, const std::string& data) {
  std::string h = "\x93NUMPY";
  h += static_cast<char>(major);
  h += '\0';
  std::string body = dict;
  const size_t len_bytes = major == 1 ? 2 : 4;
  while ((6 + 2 + len_bytes + body.size() + 1) % 64 != 0) body += ' ';
  body += '\n';
  for (size_t i = 0; i < len_bytes; ++i) h += static_cast<char>((body.size() >> (8 * i)) & 0xff);
  return h + body + data;
}

TEST(TokenStream, ReadsVersionTwoHeadersAndEveryWidth) {
  const std::string u4("\x05\x00\x00\x00\xff\x00\x00\x00", 8);
  Result<std::vector<int32_t>> ids =
      decode_token_stream(npy(2, "{'descr': '<u4', 'fortran_order': False, 'shape': (2,), }", u4), TokenInputFormat::kNpy, 256, "a");
  ASSERT_TRUE(ids.ok()) << ids.status().to_string();
  EXPECT_EQ(*ids, (std::vector<int32_t>{5, 255}));
  const std::string i8("\x07\x00\x00\x00\x00\x00\x00\x00", 8);
  ids = decode_token_stream(npy(1, "{'descr': '<i8', 'fortran_order': False, 'shape': (), }", i8), TokenInputFormat::kNpy, 8, "b");
  ASSERT_TRUE(ids.ok()) << ids.status().to_string();
  EXPECT_EQ(*ids, (std::vector<int32_t>{7}));
  // A u8 value past 2^63 is above any vocabulary, not negative.
  const std::string huge("\x00\x00\x00\x00\x00\x00\x00\x80", 8);
  ids = decode_token_stream(npy(1, "{'descr': '<u8', 'fortran_order': False, 'shape': (1,), }", huge), TokenInputFormat::kNpy, 8, "c");
  ASSERT_FALSE(ids.ok());
  EXPECT_NE(ids.status().message().find("token 9223372036854775808 at byte offset 128"), std::string::npos)
      << ids.status().message();
}

TEST(TokenStream, RefusesMalformedHeadersByName) {
  auto message = [](const std::string& bytes) {
    Result<std::vector<int32_t>> r = decode_token_stream(bytes, TokenInputFormat::kNpy, 256, "f.npy");
    return r.ok() ? std::string("ok") : r.status().message();
  };
  EXPECT_NE(message(npy(1, "{'descr': '<u2', 'shape': (1,), }", "ab")).find("lacks descr, fortran_order or shape"),
            std::string::npos);
  EXPECT_NE(message(npy(4, "{}", "")).find("format version 4"), std::string::npos);
  EXPECT_NE(message(npy(1, "{'descr': '<u2', 'fortran_order': False, 'shape': (x,), }", "ab")).find("not a count"),
            std::string::npos);
  std::string cut = npy(1, "{'descr': '<u2', 'fortran_order': False, 'shape': (1,), }", "ab");
  cut.resize(20);
  EXPECT_NE(message(cut).find("the .npy header says"), std::string::npos) << message(cut);
  EXPECT_NE(message("\x93NUMPY").find("bad magic"), std::string::npos);
}

}  // namespace
}  // namespace foldpar
