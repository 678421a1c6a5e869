// Internal to app/: pieces shared by the single-rank and the layout verification.
#pragma once

#include <string>

#include "app/verify.h"
#include "model/llama_weights.h"

namespace foldpar::verify_detail {

// Weights and tokens of a verification run, from the seed.
LlamaWeights verify_weights(const VerifyOptions& o);
Batch verify_batch(const VerifyOptions& o);

// Appends one error per gradient (state-dict order) of got against want.
void add_gradient_errors(const LlamaWeights& got, const LlamaWeights& want, VerifyReport& r);
// Sets worst, worst_name and passed from the errors (NaN counts as infinite).
void finish_report(VerifyReport& r);

// Writes config.json, model.safetensors, batch.safetensors, grads.safetensors,
// logits.safetensors ([B, S, V]) and result.json to o.dump_dir.
Status write_dump(const VerifyOptions& o, const LlamaWeights& weights, const Batch& batch, const LlamaWeights& grads,
                  const Tensor& logits, double loss, int64_t valid_tokens);

}  // namespace foldpar::verify_detail
