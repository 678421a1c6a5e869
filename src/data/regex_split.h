// A compiled PCRE2 pattern (UTF and UCP: \p{L}, \p{N} and \s are Unicode classes; JIT when
// available) that splits text the way Hugging Face's Split pre-tokenizer does. Owns no
// text: pieces are views into the caller's string. Subjects must be valid UTF-8 (the
// tokenizer checks once per encode; matching skips PCRE2's per-call check).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace foldpar {

class RegexSplit {
 public:
  enum class Behavior { kIsolated, kRemoved };  // the Split behaviours implemented

  // literal: the pattern is a plain string (Split's {"String": ...}), not a regex.
  static Result<RegexSplit> compile(const std::string& pattern, bool literal, Behavior behavior);

  // Appends to out the pieces of text: with kIsolated every match and every gap between
  // matches, in order; with kRemoved the gaps only. Empty pieces are dropped.
  void split(std::string_view text, std::vector<std::string_view>& out) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
  Behavior behavior_ = Behavior::kIsolated;
};

}  // namespace foldpar
