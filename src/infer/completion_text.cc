// Incremental decoding with stop sequences and a held-back tail.
#include "infer/completion_text.h"

#include <algorithm>

namespace foldpar {

CompletionText::CompletionText(const Tokenizer& tokenizer, std::vector<std::string> stops) : tokenizer_(tokenizer) {
  for (std::string& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

bool CompletionText::add(int32_t token) {
  if (stopped_) return true;
  tokens_.push_back(token);
  // Decoding the whole completion again lets multi-token pieces (SentencePiece spaces, UTF-8
  // split over byte tokens) come out right.
  text_ = tokenizer_.decode(tokens_);
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) cut = std::min(cut, text_.find(s));
  if (cut != std::string::npos) {
    text_.resize(cut);
    released_ = std::min(released_, cut);
    stopped_ = true;
  }
  return stopped_;
}

size_t CompletionText::safe_end() const {
  if (stopped_) return text_.size();
  // The earliest position from which the rest of the text is a proper prefix of a stop.
  for (size_t i = released_; i < text_.size(); ++i) {
    const std::string_view tail(text_.data() + i, text_.size() - i);
    for (const std::string& s : stops_)
      if (s.size() > tail.size() && std::string_view(s).substr(0, tail.size()) == tail) return i;
  }
  return text_.size();
}

std::string CompletionText::take_ready(bool finish) {
  const size_t end = finish ? text_.size() : safe_end();
  if (end <= released_) return {};
  std::string out = text_.substr(released_, end - released_);
  released_ = end;
  return out;
}

}  // namespace foldpar
