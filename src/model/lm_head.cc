// Final norm, LM head and cross-entropy on one device.
#include "model/lm_head.h"

#include "backend/bf16_storage_backend.h"

namespace foldpar {

LossSums head_forward(const BlockContext& ctx, const HeadWeights& w, const Tensor& x, const Tensor& targets,
                      int32_t ignore_index, HeadSaved& hs) {
  Backend& be = *ctx.backend;
  const int64_t T = ctx.rows(), V = ctx.config->vocab_size;
  hs.norm = norm_forward(ctx, w.final_norm, x);  // xf [T, h]
  hs.logits = Tensor::empty({T, V}, x.dtype(), MemCategory::kActivations);
  be.matmul(hs.norm.a, false, w.lm_head, true, hs.logits);  // logits = xf Whead^T
  hs.lse = Tensor::empty({T}, stat_dtype(x.dtype()), MemCategory::kActivations);
  LossSums sums;
  sums.loss_sum = be.cross_entropy_forward(hs.logits, targets, ignore_index, hs.lse);
  sums.valid_tokens = be.count_valid_targets(targets, ignore_index);
  return sums;
}

Tensor head_backward(const BlockContext& ctx, const HeadWeights& w, HeadSaved& hs, const Tensor& targets,
                     int32_t ignore_index, double grad_scale, HeadWeights& g) {
  Backend& be = *ctx.backend;
  // d_logits overwrites the logits in place.
  be.cross_entropy_backward(hs.logits, targets, hs.lse, 0, ignore_index, grad_scale, hs.logits);
  Tensor d_xf = Tensor::empty(hs.norm.a.shape(), hs.norm.a.dtype(), MemCategory::kActivations);  // [T, h]
  be.matmul(hs.logits, false, w.lm_head, false, d_xf);                // d_xf = dlogits Whead
  be.matmul(hs.logits, true, hs.norm.a, false, g.lm_head, 1.0f, 1.0f);  // dWhead += dlogits^T xf
  hs.logits = Tensor();
  return norm_backward(ctx, w.final_norm, hs.norm, d_xf, nullptr, g.final_norm);
}

}  // namespace foldpar
