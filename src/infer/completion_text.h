// CompletionText: the text of one completion as its tokens arrive. It decodes the tokens,
// watches for stop sequences, and releases text for streaming only once no stop sequence can
// still begin inside it, so a streamed completion never shows a stop sequence or its start.
// Not collective.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace foldpar {

class CompletionText {
 public:
  // `tokenizer` must outlive this object. Empty stop strings are ignored.
  CompletionText(const Tokenizer& tokenizer, std::vector<std::string> stops);

  // Appends a generated token. Returns true once the text contains a stop sequence: the
  // text is then cut where the earliest one begins and later tokens are ignored.
  bool add(int32_t token);
  bool stopped() const { return stopped_; }

  // The text that became final since the last call (all of what is left when `finish` is true).
  std::string take_ready(bool finish);

  const std::string& text() const { return text_; }        // the completion so far (cut at a stop)
  const std::vector<int32_t>& tokens() const { return tokens_; }  // tokens accepted, the stopping one included

 private:
  // The end of the text no stop sequence could still begin in.
  size_t safe_end() const;

  const Tokenizer& tokenizer_;
  std::vector<std::string> stops_;
  std::vector<int32_t> tokens_;
  std::string text_;
  size_t released_ = 0;
  bool stopped_ = false;
};

}  // namespace foldpar
