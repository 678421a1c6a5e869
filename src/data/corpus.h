// Preparing a corpus: text files -> train.tokens and val.tokens (io/token_file.h) plus
// data.json (tokenizer, vocabulary, counts, sources). Documents are split off by lines that
// hold only "%" (the fortune format) or are whole files otherwise; every 50th document goes
// to validation (2%), so both sets see every source. Token streams others wrote (.bin, .npy:
// data/token_stream.h) take the same path with documents ended by a separator token.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace foldpar {

// The English text of Debian's fortunes package: the default corpus.
constexpr const char* kDefaultCorpusDir = "/usr/share/games/fortunes";

struct PrepareOptions {
  std::vector<std::string> inputs;  // files, or directories whose regular files are read (sorted); empty: the default corpus
  std::string out_dir;              // created if missing
  std::string tokenizer;            // "" or "bytes", or a SentencePiece model path
  int validation_every = 50;        // every n-th document is held out (2%)
  // Token streams instead of text (data/token_stream.h): "text" (the default), "bin-u16",
  // "bin-u32" or "npy". The ids are kept as they are; a document ends after each
  // separator_token (which stays in the stream, so training sees the boundaries) and at the
  // end of each file. Every id must be below vocab_size (the model's).
  std::string input_format = "text";
  int64_t separator_token = -1;     // required for token streams, below vocab_size
  uint32_t vocab_size = 0;          // required for token streams
};

struct PrepareReport {
  int64_t files = 0;
  int64_t documents = 0;
  int64_t bytes = 0;
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  uint32_t vocab_size = 0;
  std::string tokenizer;
};

Result<PrepareReport> prepare_corpus(const PrepareOptions& options);

// What data.json says, read back by training.
struct CorpusInfo {
  std::string train_path, val_path;
  uint32_t vocab_size = 0;
  std::string tokenizer;
};
Result<CorpusInfo> read_corpus_info(const std::string& dir);

}  // namespace foldpar
