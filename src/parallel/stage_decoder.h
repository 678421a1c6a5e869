// StageDecoder: what a model-axis generation strategy (tsp/, megatron/ for tp) gives a pipeline stage
// (pipeline/pipeline_decoder.h), as StageStrategy does for training: the stage's weights
// (ShardedWeights of its StageLayers, global names) and the KV cache of its layers, and the
// pieces of prefill and decode over them. The pipeline decoder owns the order, the boundary
// moves between stages and the groups of sequences in flight; the strategy owns the math
// and its axis's collectives. Strategy folders implement it; pipeline/ never includes them.
//
// Every method that communicates is collective over the strategy's axis (the ranks of one
// stage): they call it in the same order with the same arguments.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "core/status.h"
#include "model/llama_weights.h"
#include "parallel/kv_cache.h"
#include "parallel/param_ref.h"
#include "parallel/sharded_weights.h"

namespace foldpar {

class StageDecoder {
 public:
  virtual ~StageDecoder() = default;

  virtual const StageLayers& layers() const = 0;
  // The strategy's axis (the boundary's messages name this rank's index on it).
  virtual Communicator& weight_axis() = 0;
  // This rank's weights (ParamRef::grad undefined) and counter-based initialization, as
  // ShardedDecoder's. Not collective.
  virtual std::vector<ParamRef> parameters() = 0;
  virtual void init_weights(const InitOptions& options) = 0;

  // Prefill (prompts validated by the caller): sizes this stage's cache (its layers, every
  // sequence) for max_new more tokens per sequence, freeing the previous one. Returns the
  // rows per sequence of what crosses to the next stage: the prefill output of sequences
  // [b0, b1) is [(b1 - b0) rows, h] (under TSP rows = S/D, this rank's tokens).
  // invalid_argument when the prompts do not fit the strategy. Not collective.
  virtual Result<int64_t> start_prefill(Backend& backend, const std::vector<std::vector<int32_t>>& prompts,
                                        int64_t max_new_tokens) = 0;
  // Then per group of consecutive sequences [b0, b1): x, the previous stage's output for
  // them (ignored on the first stage, which embeds the prompts), through this stage's
  // layers, filling their cache; returns [(b1 - b0) rows, h].
  virtual Tensor prefill(Backend& backend, int64_t b0, int64_t b1, Tensor x) = 0;
  // Last stage: x, the group's prefill output -> f32 [b1 - b0, V], each prompt's last
  // logits, on every rank of the axis.
  virtual Tensor prefill_logits(Backend& backend, int64_t b0, int64_t b1, const Tensor& x) = 0;

  // One decode step of every sequence, run as groups of consecutive sequences:
  // start_decode (every stage, once: places the B new tokens in the cache), then per group
  // [b0, b1) decode_embed (first stage), decode_layers, decode_logits (last stage), then
  // finish_decode (every sequence one token longer).
  virtual void start_decode(Backend& backend) = 0;
  // tokens: the group's new tokens -> [b1 - b0, h], the same on every rank of the axis.
  virtual Tensor decode_embed(Backend& backend, std::span<const int32_t> tokens) = 0;
  // This stage's layers over the group's rows x [b1 - b0, h]; returns [b1 - b0, h].
  virtual Tensor decode_layers(Backend& backend, int64_t b0, int64_t b1, Tensor x) = 0;
  // Last stage: x [n, h] -> f32 [n, V] on every rank of the axis.
  virtual Tensor decode_logits(Backend& backend, const Tensor& x) = 0;
  virtual void finish_decode() = 0;

  virtual const KvCache& cache() const = 0;
  // Seconds blocked on the axis's communication so far.
  virtual double blocked_seconds() const = 0;
};

}  // namespace foldpar
