// ShardedDecoder: a Llama model under one parallel layout, for generation (docs/tsp.md section 6).
// It owns this rank's weights (the ShardedWeights of tsp=D or tp=D: heads, MLP columns and
// vocabulary rows; no gradients) and its part of the KV cache. Two phases:
//   prefill  the layout's forward over the prompts; leaves the KV cache filled and returns
//            the logits of every prompt's last token.
//   decode   one new token per sequence: weights stay where they are (stationary); only
//            O(h) activations per token per layer move (parallel/decode_block.h).
// Strategies: tsp/tsp_decoder.cc (cache sharded by sequence) and megatron/megatron_decoder.cc (cache
// sharded by heads, the baseline), and pipeline/pipeline_decoder.cc (pp=P over TSP or tp stages,
// each its layers' cache); make_layout.h builds the one a layout string names.
//
// Every method that communicates is collective over the layout's communicator: every rank
// calls it in the same order with the same arguments, and gets the same logits back.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "model/llama_weights.h"
#include "parallel/kv_cache.h"
#include "parallel/param_ref.h"

namespace foldpar {

// Time this rank spent, and spent blocked on communication, in each phase so far.
struct DecoderTimes {
  double prefill_seconds = 0, prefill_comm_seconds = 0;
  double decode_seconds = 0, decode_comm_seconds = 0;
};

class ShardedDecoder {
 public:
  virtual ~ShardedDecoder() = default;

  virtual const std::string& layout() const = 0;  // "tsp=2", "tp=2"

  // This rank's weights as the loaders see them (load_checkpoint, load_hf_weights fill every
  // slice): ParamRef::grad is undefined. Not collective.
  virtual std::vector<ParamRef> parameters() = 0;
  // Counter-based weights (model/llama_weights.h), equal to the single-rank model's.
  virtual void init_weights(const InitOptions& options) = 0;

  // Runs the prompts (token ids; each non-empty, ids in the vocabulary) through the model and
  // sizes the KV cache for `max_new_tokens` more tokens per sequence; the previous cache, if
  // any, is freed first. Returns f32 [B, V]: the logits at each prompt's last token.
  // invalid_argument for empty prompts, bad ids, or a prompt plus max_new_tokens beyond
  // max_position_embeddings. Collective.
  virtual Result<Tensor> prefill(Backend& backend, const std::vector<std::vector<int32_t>>& prompts,
                                 int64_t max_new_tokens) = 0;
  // Appends one token per sequence (tokens[b] follows sequence b) and returns f32 [B, V]: the
  // logits after it. invalid_argument before prefill, beyond the max_new_tokens given
  // there, for a wrong count or for an id outside the vocabulary. Collective.
  virtual Result<Tensor> decode(Backend& backend, std::span<const int32_t> tokens) = 0;

  // Decoding with groups of sequences kept in flight across steps (a pipeline decoder with
  // at least as many sequences as stages; docs/composition.md section 2, Generation): the
  // caller's sampler runs inside the loop, once per group and step, instead of between
  // decode calls. Chooses the next tokens of sequences [b0, b0 + tokens.size()) from their
  // logits (f32 [n, V]) into `tokens`; returns true once every sequence of the batch has
  // finished, which ends the decoding.
  using GroupChooser = std::function<bool(int64_t b0, const Tensor& logits, std::span<int32_t> tokens)>;
  // Whether this decoder runs decode_in_flight for a batch of `batch` sequences.
  virtual bool decodes_in_flight(int64_t /*batch*/) const { return false; }
  // After prefill: `tokens` (one per sequence, as decode's) go in, then `choose` (given on
  // world rank 0 only, which is stage 0's first rank) picks every later token, until it says
  // every sequence has finished; decode() is refused after it until the next prefill.
  // Returns the token rows the decode steps computed (finished sequences' included).
  // Collective.
  virtual Result<int64_t> decode_in_flight(Backend& /*backend*/, std::span<const int32_t> /*tokens*/,
                                           const GroupChooser& /*choose*/) {
    return unimplemented("layout {}: decoding with groups in flight is a pipeline decoder's", layout());
  }

  // Tokens of sequence b so far (prompt plus decoded); 0 before prefill.
  virtual int64_t sequence_length(int64_t b) const = 0;
  // This rank's KV cache (empty before prefill).
  virtual const KvCache& cache() const = 0;
  virtual DecoderTimes times() const = 0;
};

// What every strategy checks before a prefill: at least one prompt, none empty, ids in
// [0, V), and each prompt plus max_new_tokens (>= 0) within max_position_embeddings. The
// messages name the prompt and the numbers.
Status validate_prompts(const LlamaConfig& config, const std::vector<std::vector<int32_t>>& prompts,
                        int64_t max_new_tokens);
// ... and before a decode step: `decoded` steps done of `max_new_tokens`, one token per
// sequence of `batch`, ids in [0, V).
Status validate_decode_tokens(const LlamaConfig& config, std::span<const int32_t> tokens, int64_t batch,
                              int64_t decoded, int64_t max_new_tokens);

}  // namespace foldpar
