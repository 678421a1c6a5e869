// Token files, tokenizers, corpus preparation and the deterministic loader.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "data/corpus.h"
#include "data/data_loader.h"
#include "data/tokenizer.h"
#include "io/token_file.h"

#include <sentencepiece_trainer.h>

namespace foldpar {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("foldpar_data_test_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(TokenFile, RoundTripsEveryWidth) {
  TempDir dir;
  for (uint32_t vocab : {7u, 256u, 300u, 70000u}) {
    std::vector<int32_t> ids;
    for (uint32_t i = 0; i < 1000; ++i) ids.push_back(static_cast<int32_t>((i * 7919u) % vocab));
    const fs::path p = dir.path / ("t" + std::to_string(vocab));
    ASSERT_TRUE(write_token_file(p.string(), vocab, ids).ok());
    EXPECT_EQ(fs::file_size(p), kTokenFileHeaderBytes + ids.size() * token_width_for(vocab));
    Result<TokenFile> back = read_token_file(p.string());
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(back->vocab_size, vocab);
    EXPECT_EQ(back->ids, ids);
  }
  EXPECT_FALSE(write_token_file((dir.path / "bad").string(), 10, {3, 10}).ok());
  EXPECT_FALSE(fs::exists(dir.path / "bad"));
}

TEST(TokenFile, RejectsMalformedFiles) {
  TempDir dir;
  const fs::path p = dir.path / "good";
  ASSERT_TRUE(write_token_file(p.string(), 300, {1, 2, 299}).ok());
  const std::string good = read_all(p);
  auto message = [](std::string bytes) {
    Result<TokenFile> f = parse_token_file(bytes);
    EXPECT_FALSE(f.ok());
    return f.ok() ? std::string() : f.status().message();
  };
  EXPECT_NE(message(good.substr(0, 20)).find("shorter than its 32-byte header"), std::string::npos);
  EXPECT_NE(message("XX" + good.substr(2)).find("bad magic"), std::string::npos);
  EXPECT_NE(message(good.substr(0, good.size() - 1)).find("announces 3 ids"), std::string::npos);
  EXPECT_NE(message(good + "xx").find("announces 3 ids"), std::string::npos);
  std::string huge = good;
  huge[31] = '\x7f';  // count near 2^63: must not allocate
  EXPECT_NE(message(huge).find("announces"), std::string::npos);
  std::string out_of_vocab = good;  // the third id (2 bytes at offset 4) becomes 0xffff
  out_of_vocab[kTokenFileHeaderBytes + 4] = '\xff';
  out_of_vocab[kTokenFileHeaderBytes + 5] = '\xff';
  EXPECT_NE(message(out_of_vocab).find("outside the vocabulary"), std::string::npos);
  std::string width = good;
  width[16] = 3;
  EXPECT_NE(message(width).find("width 3"), std::string::npos);
  EXPECT_EQ(read_token_file((dir.path / "missing").string()).status().code(), StatusCode::kNotFound);
}

TEST(Tokenizer, BytesRoundTrip) {
  auto tok = make_byte_tokenizer();
  const std::string text = "Caf\xc3\xa9 % 42\n";
  const std::vector<int32_t> ids = tok->encode(text);
  EXPECT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[3], 0xc3);
  EXPECT_EQ(tok->decode(ids), text);
  EXPECT_EQ(tok->vocab_size(), 256u);
  EXPECT_FALSE(make_tokenizer("/nonexistent/model.model").ok());
}

TEST(Tokenizer, SentencePieceModelPreparesACorpus) {
  // Train a small SentencePiece model here (libsentencepiece's trainer), then prepare a
  // corpus with it: ids below its vocabulary, and decoding gives the text back.
  TempDir dir;
  std::ofstream text(dir.path / "text.txt");
  for (int i = 0; i < 200; ++i) text << "the quick brown fox " << i % 17 << " jumps over the lazy dog\n%\n";
  text.close();
  const std::string prefix = (dir.path / "spm").string();
  const auto status = sentencepiece::SentencePieceTrainer::Train("--input=" + (dir.path / "text.txt").string() +
                                                                 " --model_prefix=" + prefix +
                                                                 " --vocab_size=48 --hard_vocab_limit=false --minloglevel=2");
  ASSERT_TRUE(status.ok()) << status.ToString();
  Result<std::unique_ptr<Tokenizer>> tok = make_tokenizer(prefix + ".model");
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const uint32_t vocab = (*tok)->vocab_size();
  EXPECT_GE(vocab, 41u);
  EXPECT_LE(vocab, 48u);
  const std::vector<int32_t> ids = (*tok)->encode("the lazy dog");
  EXPECT_GT(ids.size(), 0u);
  EXPECT_EQ((*tok)->decode(ids), "the lazy dog");
  PrepareOptions o;
  o.inputs = {(dir.path / "text.txt").string()};
  o.out_dir = (dir.path / "out").string();
  o.tokenizer = prefix + ".model";
  Result<PrepareReport> r = prepare_corpus(o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->vocab_size, vocab);
  Result<TokenFile> train = read_token_file((dir.path / "out" / "train.tokens").string());
  ASSERT_TRUE(train.ok());
  EXPECT_EQ(train->vocab_size, vocab);
  for (int32_t id : train->ids) ASSERT_LT(static_cast<uint32_t>(id), vocab);
  EXPECT_EQ(read_corpus_info(o.out_dir)->tokenizer, "sentencepiece:" + prefix + ".model");
}

TEST(Corpus, HoldsOutEveryFiftiethDocument) {
  TempDir dir;
  fs::create_directories(dir.path / "in");
  std::ofstream a(dir.path / "in" / "a");
  for (int i = 0; i < 120; ++i) a << "fortune number " << i << "\n%\n";
  a.close();
  std::ofstream b(dir.path / "in" / "b.dat");  // a fortune index: skipped
  b << "binary";
  b.close();
  PrepareOptions o;
  o.inputs = {(dir.path / "in").string()};
  o.out_dir = (dir.path / "out").string();
  Result<PrepareReport> r = prepare_corpus(o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->files, 1);
  EXPECT_EQ(r->documents, 120);
  Result<CorpusInfo> info = read_corpus_info(o.out_dir);
  ASSERT_TRUE(info.ok());
  Result<TokenFile> val = read_token_file(info->val_path);
  ASSERT_TRUE(val.ok());
  auto tok = make_byte_tokenizer();
  // Documents 49 and 99 are held out.
  EXPECT_EQ(tok->decode(val->ids), "fortune number 49\nfortune number 99\n");
  EXPECT_EQ(r->train_tokens + r->val_tokens, r->bytes - 120 * 2);  // every "%\n" separator dropped
  o.inputs = {(dir.path / "nothing").string()};
  EXPECT_EQ(prepare_corpus(o).status().code(), StatusCode::kNotFound);
}

TEST(DataLoader, DeterministicRowsAndShiftedTargets) {
  auto tokens = std::make_shared<TokenFile>();
  tokens->vocab_size = 1000;
  for (int i = 0; i < 1000; ++i) tokens->ids.push_back(i);
  Result<DataLoader> loader = DataLoader::create(tokens, 16, 5);
  ASSERT_TRUE(loader.ok());
  const Batch all = loader->train_rows(3, 0, 4), tail = loader->train_rows(3, 2, 4), other = loader->train_rows(4, 0, 4);
  for (int64_t i = 0; i < 2 * 16; ++i) EXPECT_EQ(all.input_ids.data<int32_t>()[2 * 16 + i], tail.input_ids.data<int32_t>()[i]);
  bool differs = false;
  for (int64_t i = 0; i < 4 * 16; ++i) {
    EXPECT_EQ(all.target_ids.data<int32_t>()[i], all.input_ids.data<int32_t>()[i] + 1);  // ids are positions here
    differs |= all.input_ids.data<int32_t>()[i] != other.input_ids.data<int32_t>()[i];
  }
  EXPECT_TRUE(differs);
  const Batch v = loader->sequential_rows(1, 2, 0, 2);
  EXPECT_EQ(v.input_ids.data<int32_t>()[0], 2 * 16);  // window 2
  EXPECT_EQ(v.input_ids.data<int32_t>()[16], 3 * 16);
  tokens->ids.resize(10);
  EXPECT_FALSE(DataLoader::create(tokens, 16, 5).ok());
}

}  // namespace
}  // namespace foldpar
