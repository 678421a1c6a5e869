// The head and loss of the single-device model: final norm, LM head over the full
// vocabulary, cross-entropy sum and count; forward and backward. No communication (TSP's
// vocabulary ring keeps its own online log-sum-exp and reuses only the norm sub-block).
#pragma once

#include "model/llama_weights.h"
#include "model/sub_blocks.h"

namespace foldpar {

struct HeadWeights {
  Tensor final_norm;  // [h]
  Tensor lm_head;     // [V, h]
};

struct HeadSaved {
  NormSaved norm;  // x_last [T, h] (the last block's output), rstd [T], xf [T, h]
  Tensor logits;   // [T, V]
  Tensor lse;      // [T]
};

// LossSums (backend/backend.h): the loss sum and valid targets of a batch.

// x: [T, h]; targets: i32 [T]. Fills `saved` (the backward needs all of it).
LossSums head_forward(const BlockContext& ctx, const HeadWeights& w, const Tensor& x, const Tensor& targets,
                      int32_t ignore_index, HeadSaved& saved);

// The gradient of loss_sum * grad_scale. Overwrites saved.logits with d_logits and releases
// them; g += the weight gradients. Returns d x_last [T, h].
Tensor head_backward(const BlockContext& ctx, const HeadWeights& w, HeadSaved& saved, const Tensor& targets,
                     int32_t ignore_index, double grad_scale, HeadWeights& g);

}  // namespace foldpar
