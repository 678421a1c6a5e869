// Corpus preparation.
#include "data/corpus.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/token_stream.h"
#include "data/tokenizer.h"
#include "io/atomic_file.h"
#include "io/posix_file.h"
#include "io/token_file.h"

namespace foldpar {
namespace fs = std::filesystem;
namespace {

bool is_corpus_file(const fs::path& p) {
  // Debian's fortune directories also hold binary indexes (.dat) and UTF-8 aliases (.u8).
  const std::string ext = p.extension().string();
  return fs::is_regular_file(p) && !fs::is_symlink(p) && ext != ".dat" && ext != ".u8";
}

Result<std::vector<fs::path>> list_files(const std::vector<std::string>& inputs) {
  std::vector<fs::path> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    if (fs::is_directory(in, ec)) {
      std::vector<fs::path> found;
      for (const auto& e : fs::directory_iterator(in, ec))
        if (is_corpus_file(e.path())) found.push_back(e.path());
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(in, ec)) {
      files.emplace_back(in);
    } else {
      return not_found("input '{}' is neither a file nor a directory", in);
    }
  }
  if (files.empty()) return invalid_argument("no input files found in {}", fmt::join(inputs, ", "));
  return files;
}

// Splits at lines that are exactly "%".
std::vector<std::string> split_documents(const std::string& text) {
  std::vector<std::string> docs;
  std::string cur;
  std::istringstream in(text);
  bool saw_separator = false;
  for (std::string line; std::getline(in, line);) {
    if (line == "%") {
      saw_separator = true;
      if (!cur.empty()) docs.push_back(std::move(cur));
      cur.clear();
      continue;
    }
    cur += line;
    cur += '\n';
  }
  if (!cur.empty()) docs.push_back(std::move(cur));
  if (!saw_separator && docs.size() > 1) docs = {text};
  return docs;
}

Status write_json(const fs::path& path, const nlohmann::ordered_json& j) {
  const std::string text = j.dump(2) + "\n";
  return write_file_atomically(path.string(), [&](int fd, const std::string& tmp) {
    return write_fully(fd, tmp, text.data(), text.size());
  });
}

// Writes train.tokens, val.tokens and data.json into o.out_dir.
Result<PrepareReport> write_corpus(const PrepareOptions& o, const std::vector<std::string>& inputs, PrepareReport r,
                                   const std::vector<int32_t>& train, const std::vector<int32_t>& val) {
  if (train.empty() || val.empty())
    return invalid_argument("the corpus has {} documents: too few to hold out every {}th for validation", r.documents,
                            o.validation_every);
  std::error_code ec;
  fs::create_directories(o.out_dir, ec);
  if (ec) return io_error("cannot create '{}': {}", o.out_dir, ec.message());
  const fs::path dir(o.out_dir);
  FP_RETURN_IF_ERROR(write_token_file((dir / "train.tokens").string(), r.vocab_size, train));
  FP_RETURN_IF_ERROR(write_token_file((dir / "val.tokens").string(), r.vocab_size, val));
  r.train_tokens = static_cast<int64_t>(train.size());
  r.val_tokens = static_cast<int64_t>(val.size());
  nlohmann::ordered_json j;
  j["tokenizer"] = r.tokenizer;
  j["vocab_size"] = r.vocab_size;
  j["train"] = "train.tokens";
  j["val"] = "val.tokens";
  j["train_tokens"] = r.train_tokens;
  j["val_tokens"] = r.val_tokens;
  j["documents"] = r.documents;
  j["sources"] = inputs;
  FP_RETURN_IF_ERROR(write_json(dir / "data.json", j));
  return r;
}

// Token streams: documents end after each separator and at each file's end.
Result<PrepareReport> prepare_token_corpus(const PrepareOptions& o, TokenInputFormat format) {
  if (o.vocab_size == 0) return invalid_argument("--input-format {} needs the model's vocabulary (--model)", o.input_format);
  if (o.separator_token < 0 || o.separator_token >= o.vocab_size)
    return invalid_argument("--separator-token ({}) must be given and below the vocabulary size {}", o.separator_token,
                            o.vocab_size);
  if (o.inputs.empty()) return invalid_argument("--input-format {} needs --input files", o.input_format);
  FP_ASSIGN_OR_RETURN(std::vector<fs::path> files, list_files(o.inputs));
  PrepareReport r;
  r.vocab_size = o.vocab_size;
  r.tokenizer = fmt::format("pretokenized:{} (separator {})", o.input_format, o.separator_token);
  std::vector<int32_t> train, val;
  for (const fs::path& f : files) {
    FP_ASSIGN_OR_RETURN(std::vector<int32_t> ids, read_token_stream(f.string(), format, o.vocab_size));
    ++r.files;
    r.bytes += static_cast<int64_t>(fs::file_size(f));
    for (size_t begin = 0; begin < ids.size();) {
      size_t end = begin;
      while (end < ids.size() && ids[end] != o.separator_token) ++end;
      end = std::min(end + 1, ids.size());  // the separator ends its document
      std::vector<int32_t>& dst = (r.documents % o.validation_every == o.validation_every - 1) ? val : train;
      dst.insert(dst.end(), ids.begin() + static_cast<ptrdiff_t>(begin), ids.begin() + static_cast<ptrdiff_t>(end));
      ++r.documents;
      begin = end;
    }
  }
  return write_corpus(o, o.inputs, std::move(r), train, val);
}

}  // namespace

Result<PrepareReport> prepare_corpus(const PrepareOptions& o) {
  if (o.out_dir.empty()) return invalid_argument("an output directory is required");
  if (o.validation_every < 2) return invalid_argument("validation_every ({}) must be at least 2", o.validation_every);
  FP_ASSIGN_OR_RETURN(TokenInputFormat format, token_input_format_from_name(o.input_format));
  if (format != TokenInputFormat::kText) {
    if (!o.tokenizer.empty() && o.tokenizer != "bytes")
      return invalid_argument("--tokenizer {} is for text; --input-format {} holds token ids already", o.tokenizer,
                              o.input_format);
    return prepare_token_corpus(o, format);
  }
  FP_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, make_tokenizer(o.tokenizer));
  const std::vector<std::string> inputs = o.inputs.empty() ? std::vector<std::string>{kDefaultCorpusDir} : o.inputs;
  FP_ASSIGN_OR_RETURN(std::vector<fs::path> files, list_files(inputs));
  PrepareReport r;
  r.vocab_size = tok->vocab_size();
  r.tokenizer = tok->describe();
  std::vector<int32_t> train, val;
  for (const fs::path& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) return io_error("cannot read '{}'", f.string());
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    ++r.files;
    r.bytes += static_cast<int64_t>(text.size());
    for (const std::string& doc : split_documents(text)) {
      const std::vector<int32_t> ids = tok->encode(doc);
      std::vector<int32_t>& dst = (r.documents % o.validation_every == o.validation_every - 1) ? val : train;
      dst.insert(dst.end(), ids.begin(), ids.end());
      ++r.documents;
    }
  }
  return write_corpus(o, inputs, std::move(r), train, val);
}

Result<CorpusInfo> read_corpus_info(const std::string& dir) {
  const fs::path path = fs::path(dir) / "data.json";
  std::ifstream in(path);
  if (!in) return not_found("'{}' is not a prepared corpus (no data.json; run foldpar prepare-data)", dir);
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("train") || !j["train"].is_string() || !j.contains("val") ||
      !j["val"].is_string() || !j.contains("vocab_size") || !j["vocab_size"].is_number_unsigned())
    return corrupt("'{}' is not a valid corpus description", path.string());
  CorpusInfo info;
  info.train_path = (fs::path(dir) / j["train"].get<std::string>()).string();
  info.val_path = (fs::path(dir) / j["val"].get<std::string>()).string();
  info.vocab_size = j["vocab_size"].get<uint32_t>();
  if (j.contains("tokenizer") && j["tokenizer"].is_string()) info.tokenizer = j["tokenizer"].get<std::string>();
  return info;
}

}  // namespace foldpar
