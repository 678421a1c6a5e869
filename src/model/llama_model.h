// The single-device Llama model: embedding, L blocks, final norm, LM head and the mean
// cross-entropy; forward, and forward + backward with a choice of activation recomputation.
// This is the reference every parallel layout is held to.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "model/llama_config.h"
#include "model/llama_weights.h"

namespace foldpar {

constexpr int32_t kIgnoreIndex = -100;  // target id that carries no loss (PyTorch's default)

// One micro-batch of token ids. target_ids[b, t] is the token to predict at position t
// (already shifted), or kIgnoreIndex.
struct Batch {
  Tensor input_ids;   // i32 [B, S]
  Tensor target_ids;  // i32 [B, S]
  int64_t batch() const { return input_ids.dim(0); }
  int64_t seq() const { return input_ids.dim(1); }
};

enum class Recompute {
  kNone,   // keep every block's activations from forward to backward
  kBlock,  // keep only each block's input; rerun the block's forward inside backward
};

struct StepOptions {
  Recompute recompute = Recompute::kNone;
  bool keep_logits = false;  // return the logits [B, S, V] (costs B*S*V elements)
  // Gradient accumulation: the gradient is that of loss_sum / loss_normalizer (the step's
  // valid tokens over all its micro-batches) and, for a MoE model, of the aux term weighted
  // by this batch's share valid_tokens / loss_normalizer; 0: this batch's valid tokens.
  int64_t loss_normalizer = 0;
};

struct StepResult {
  double loss = 0;           // loss_sum / valid_tokens (0 when no token is valid)
  double loss_sum = 0;       // sum of per-token cross-entropies over valid tokens
  int64_t valid_tokens = 0;  // targets that are not kIgnoreIndex
  Tensor logits;             // [B, S, V] when keep_logits
  double exposed_comm_seconds = 0;  // parallel layouts: time blocked on communication
  // MoE models: the load-balancing loss (unscaled; `loss` includes router_aux_loss_coef times
  // it when output_router_logits) and the tokens each expert received over every sparse layer.
  double aux_loss = 0;
  std::vector<int64_t> expert_load;  // [E]
  int64_t moe_dropped = 0;           // token-expert pairs dropped over capacity (MoeAux::dropped_pairs)
};

// Checks shapes, dtypes and id ranges of a batch against the config (user data: a Status);
// the ids are read through be.copy_to_host.
Status validate_batch(Backend& be, const LlamaConfig& config, const Batch& batch);

// Forward only: the loss (and logits when asked).
Result<StepResult> model_forward(const LlamaConfig& config, Backend& backend, const LlamaWeights& weights,
                                 const Batch& batch, const StepOptions& options);

// Forward and backward; gradients of the mean loss are accumulated (+=) into `grads`
// (allocate with LlamaWeights::allocate(..., kGradients) and zero() them first).
Result<StepResult> model_forward_backward(const LlamaConfig& config, Backend& backend, const LlamaWeights& weights,
                                          const Batch& batch, const StepOptions& options, LlamaWeights& grads);

}  // namespace foldpar
