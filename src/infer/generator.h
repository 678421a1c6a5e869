// Generation over a ShardedDecoder (parallel/sharded_decoder.h): prompts in, completions out.
// Per batch of prompts: one prefill, then one decode step per new token (or, where the
// decoder keeps groups in flight, its decode_in_flight loop with rank 0's choices inside). Rank 0 chooses every
// token (infer/sampler.h), watches stop sequences and streams text; it broadcasts the chosen
// tokens and a stop flag over `world` each step (B + 1 i32 values), so every rank feeds the
// decoder the same tokens whatever its floating-point environment. A finished sequence keeps
// its slot in the batch until every sequence has finished (its tokens are ignored).
// Collective over `world`, which must hold exactly the decoder's ranks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "comm/communicator.h"
#include "data/tokenizer.h"
#include "infer/sampler.h"
#include "parallel/sharded_decoder.h"

namespace foldpar {

struct GenerationOptions {
  int64_t max_new_tokens = 128;    // per prompt, >= 1
  SamplingOptions sampling;
  std::vector<std::string> stop;   // stop sequences: generation ends where one appears (not shown)
  int64_t batch = 0;               // prompts decoded together; 0: all of them
  // A decoder that keeps groups of sequences in flight across steps (under pp with B >= p,
  // ShardedDecoder::decodes_in_flight) runs that way: rank 0 chooses each group's tokens as
  // its logits arrive, and no step waits for the whole batch. false: one decode call per
  // step (every stage fills and drains each step; generate --lockstep). The tokens are the same.
  bool in_flight = true;
};

struct Completion {
  std::string prompt;
  std::string text;                // the generated text, cut before a stop sequence
  std::vector<int32_t> tokens;     // generated tokens (the one completing a stop included)
  std::string stop_reason;         // "stop" (a stop sequence) or "length" (max_new_tokens)
};

struct GenerationReport {
  std::vector<Completion> completions;  // prompt order; filled on rank 0 only
  int64_t prompt_tokens = 0;            // prefilled, over every batch
  double prefill_seconds = 0;
  int64_t decode_tokens = 0;            // tokens the decode steps processed: steps x batch size, finished
                                        // sequences' slots included (what the model computed)
  int64_t generated_tokens = 0;         // rank 0: tokens in the completions (what the user got)
  double decode_seconds = 0;            // the decode steps, with sampling and the broadcasts
  int64_t cache_bytes = 0;              // this rank's largest KV cache
  double prefill_tokens_per_second() const { return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0; }
  double decode_tokens_per_second() const { return decode_seconds > 0 ? decode_tokens / decode_seconds : 0; }
  // Completion tokens per second of prefill and decode together (rank 0).
  double generated_tokens_per_second() const {
    const double t = prefill_seconds + decode_seconds;
    return t > 0 ? generated_tokens / t : 0;
  }
};

// Called on rank 0 only. on_text(i, piece): more final text of completion i (prompt index);
// on_done(i, completion): completion i has finished.
struct GenerationCallbacks {
  std::function<void(int64_t, std::string_view)> on_text;
  std::function<void(int64_t, const Completion&)> on_done;
};

// invalid_argument for bad options, a prompt that encodes to no tokens or ids beyond the
// model's vocabulary (prompt index named). Collective over `world`.
Result<GenerationReport> generate(ShardedDecoder& decoder, Backend& backend, const Tokenizer& tokenizer,
                                  const std::vector<std::string>& prompts, const GenerationOptions& options,
                                  Communicator& world, const GenerationCallbacks& callbacks = {});

}  // namespace foldpar
