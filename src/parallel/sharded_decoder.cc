// The checks every ShardedDecoder makes on its inputs.
#include "parallel/sharded_decoder.h"

namespace foldpar {

Status validate_prompts(const LlamaConfig& c, const std::vector<std::vector<int32_t>>& prompts,
                        int64_t max_new_tokens) {
  if (prompts.empty()) return invalid_argument("no prompts to generate from");
  if (max_new_tokens < 0) return invalid_argument("max new tokens ({}) must not be negative", max_new_tokens);
  for (size_t b = 0; b < prompts.size(); ++b) {
    const std::vector<int32_t>& p = prompts[b];
    if (p.empty()) return invalid_argument("prompt {} has no tokens", b);
    for (size_t i = 0; i < p.size(); ++i)
      if (p[i] < 0 || p[i] >= c.vocab_size)
        return invalid_argument("prompt {}: token {} at index {} outside the vocabulary [0, {})", b, p[i], i,
                                c.vocab_size);
    const int64_t total = static_cast<int64_t>(p.size()) + max_new_tokens;
    if (c.max_position_embeddings > 0 && total > c.max_position_embeddings)
      return invalid_argument("prompt {} ({} tokens) plus {} new tokens exceeds max_position_embeddings ({})", b,
                              p.size(), max_new_tokens, c.max_position_embeddings);
  }
  return Status();
}

Status validate_decode_tokens(const LlamaConfig& c, std::span<const int32_t> tokens, int64_t batch, int64_t decoded,
                              int64_t max_new_tokens) {
  if (batch == 0) return invalid_argument("decode before prefill");
  if (decoded >= max_new_tokens)
    return invalid_argument("decode step {} beyond the {} new tokens the cache was sized for", decoded + 1,
                            max_new_tokens);
  if (static_cast<int64_t>(tokens.size()) != batch)
    return invalid_argument("decode step with {} tokens for {} sequences", tokens.size(), batch);
  for (size_t b = 0; b < tokens.size(); ++b)
    if (tokens[b] < 0 || tokens[b] >= c.vocab_size)
      return invalid_argument("sequence {}: token {} outside the vocabulary [0, {})", b, tokens[b], c.vocab_size);
  return Status();
}

}  // namespace foldpar
