// PCRE2 (8-bit code units, UTF + UCP) behind RegexSplit.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/regex_split.h"

#include <pcre2.h>

#include "core/check.h"

namespace foldpar {

struct RegexSplit::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(code); }
};

Result<RegexSplit> RegexSplit::compile(const std::string& pattern, bool literal, Behavior behavior) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  const uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0u);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error,
                                   &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return invalid_argument("regex '{}' does not compile at offset {}: {}", pattern, offset,
                            reinterpret_cast<const char*>(message));
  }
  auto owned = std::make_shared<Code>();
  owned->code = code;
  owned->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  RegexSplit r;
  r.code_ = std::move(owned);
  r.behavior_ = behavior;
  return r;
}

void RegexSplit::split(std::string_view text, std::vector<std::string_view>& out) const {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  FP_CHECK(md != nullptr, "pcre2_match_data_create failed");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0, gap_start = 0;
  while (pos < text.size()) {
    const int rc = code_->jit ? pcre2_jit_match(code_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr)
                              : pcre2_match(code_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    FP_CHECK(rc > 0, "pcre2_match failed with {}", rc);
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t begin = ov[0], end = ov[1];
    if (end == begin) {  // an empty match: step over one UTF-8 character
      pos = begin + 1;
      while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xc0) == 0x80) ++pos;
      continue;
    }
    if (begin > gap_start) out.push_back(text.substr(gap_start, begin - gap_start));
    if (behavior_ == Behavior::kIsolated) out.push_back(text.substr(begin, end - begin));
    gap_start = pos = end;
  }
  if (gap_start < text.size()) out.push_back(text.substr(gap_start));
  pcre2_match_data_free(md);
}

}  // namespace foldpar
