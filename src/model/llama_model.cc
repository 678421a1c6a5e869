// Single-device Llama forward and backward over the blocks of llama_block.cc.
#include "model/llama_model.h"

#include <numeric>
#include <vector>

#include "backend/bf16_storage_backend.h"
#include "backend/rope_table.h"
#include "model/llama_block.h"

namespace foldpar {
namespace {

// Positions 0..S-1 and their RoPE table, shared by every block of one step.
struct StepConstants {
  Tensor positions;   // i32 [S]
  Tensor rope_table;  // [S, 2, d/2]
  BlockContext ctx;
};

void make_constants(const LlamaConfig& c, Backend& be, const Batch& batch, DType dtype, StepConstants& k) {
  const int64_t S = batch.seq();
  k.positions = Tensor::empty({S}, DType::kI32, MemCategory::kActivations);
  std::iota(k.positions.data<int32_t>(), k.positions.data<int32_t>() + S, 0);
  k.rope_table = build_rope_table({k.positions.data<int32_t>(), static_cast<size_t>(S)}, c.head_dim(), c.rope_theta,
                                  stat_dtype(dtype));
  k.ctx = BlockContext{&c, &be, batch.batch(), S, &k.positions, &k.rope_table};
}

Tensor embed(const LlamaConfig& c, Backend& be, const LlamaWeights& w, const Batch& batch) {
  Tensor x = Tensor::empty({batch.batch() * batch.seq(), c.hidden_size}, w.embed.dtype(), MemCategory::kActivations);
  be.embedding_forward(batch.input_ids.reshape({x.dim(0)}), w.embed, 0, x);
  return x;
}

// Final norm, LM head and loss. Fills the head's saved tensors when asked.
struct HeadSaved {
  Tensor x_last;  // [T, h] last block output
  Tensor rstd;    // [T]
  Tensor xf;      // [T, h] normed
  Tensor logits;  // [T, V]
  Tensor lse;     // [T]
};

void head_forward(const LlamaConfig& c, Backend& be, const LlamaWeights& w, const Batch& batch, const Tensor& x,
                  HeadSaved& hs, StepResult& result) {
  const int64_t T = x.dim(0);
  hs.x_last = x;
  hs.rstd = Tensor::empty({T}, stat_dtype(x.dtype()), MemCategory::kActivations);
  hs.xf = Tensor::empty({T, c.hidden_size}, x.dtype(), MemCategory::kActivations);
  be.rmsnorm_forward(x, w.final_norm, c.rms_norm_eps, hs.xf, hs.rstd);
  hs.logits = Tensor::empty({T, c.vocab_size}, x.dtype(), MemCategory::kActivations);
  be.matmul(hs.xf, false, w.lm_head, true, hs.logits);
  hs.lse = Tensor::empty({T}, stat_dtype(x.dtype()), MemCategory::kActivations);
  const Tensor targets = batch.target_ids.reshape({T});
  result.loss_sum = be.cross_entropy_forward(hs.logits, targets, kIgnoreIndex, hs.lse);
  result.valid_tokens = count_valid_targets(targets, kIgnoreIndex);
  result.loss = result.valid_tokens > 0 ? result.loss_sum / static_cast<double>(result.valid_tokens) : 0.0;
}

}  // namespace

Status validate_batch(const LlamaConfig& c, const Batch& batch) {
  const Tensor &ids = batch.input_ids, &tg = batch.target_ids;
  if (ids.rank() != 2 || ids.dtype() != DType::kI32 || tg.shape() != ids.shape() || tg.dtype() != DType::kI32)
    return invalid_argument("batch: input_ids {} and target_ids {} must both be i32 [B, S]", ids.describe(),
                            tg.describe());
  if (batch.batch() <= 0 || batch.seq() <= 0)
    return invalid_argument("batch: B ({}) and S ({}) must be positive", batch.batch(), batch.seq());
  for (int64_t i = 0; i < ids.numel(); ++i) {
    const int32_t id = ids.data<int32_t>()[i], t = tg.data<int32_t>()[i];
    if (id < 0 || id >= c.vocab_size)
      return invalid_argument("batch: input id {} at index {} outside the vocabulary [0, {})", id, i, c.vocab_size);
    if (t != kIgnoreIndex && (t < 0 || t >= c.vocab_size))
      return invalid_argument("batch: target id {} at index {} outside the vocabulary [0, {}) and not {}", t, i,
                              c.vocab_size, kIgnoreIndex);
  }
  return Status();
}

Result<StepResult> model_forward(const LlamaConfig& c, Backend& be, const LlamaWeights& w, const Batch& batch,
                                 const StepOptions& options) {
  FP_RETURN_IF_ERROR(validate_batch(c, batch));
  StepConstants k;
  make_constants(c, be, batch, w.embed.dtype(), k);
  Tensor x = embed(c, be, w, batch);
  for (const LayerWeights& lw : w.layers) x = block_forward(k.ctx, lw, x, nullptr);
  HeadSaved hs;
  StepResult result;
  head_forward(c, be, w, batch, x, hs, result);
  if (options.keep_logits) result.logits = hs.logits.reshape({batch.batch(), batch.seq(), c.vocab_size});
  return result;
}

Result<StepResult> model_forward_backward(const LlamaConfig& c, Backend& be, const LlamaWeights& w,
                                          const Batch& batch, const StepOptions& options, LlamaWeights& g) {
  FP_RETURN_IF_ERROR(validate_batch(c, batch));
  StepConstants k;
  make_constants(c, be, batch, w.embed.dtype(), k);
  const size_t L = w.layers.size();
  const bool keep = options.recompute == Recompute::kNone;

  // Forward. saved[l].x_in is all that is kept under Recompute::kBlock.
  std::vector<BlockSaved> saved(L);
  Tensor x = embed(c, be, w, batch);
  for (size_t l = 0; l < L; ++l) {
    if (!keep) saved[l].x_in = x;
    x = block_forward(k.ctx, w.layers[l], x, keep ? &saved[l] : nullptr);
  }
  HeadSaved hs;
  StepResult result;
  head_forward(c, be, w, batch, x, hs, result);
  x = Tensor();
  if (options.keep_logits) {
    result.logits = hs.logits.clone(MemCategory::kActivations).reshape({batch.batch(), batch.seq(), c.vocab_size});
  }

  // Backward of loss = loss_sum / valid_tokens; d_logits overwrites the logits in place.
  const int64_t T = hs.xf.dim(0);
  const double grad_scale = result.valid_tokens > 0 ? 1.0 / static_cast<double>(result.valid_tokens) : 0.0;
  be.cross_entropy_backward(hs.logits, batch.target_ids.reshape({T}), hs.lse, 0, kIgnoreIndex, grad_scale,
                            hs.logits);
  Tensor d_xf = Tensor::empty({T, c.hidden_size}, hs.xf.dtype(), MemCategory::kActivations);
  be.matmul(hs.logits, false, w.lm_head, false, d_xf);                // d_xf = dlogits Whead
  be.matmul(hs.logits, true, hs.xf, false, g.lm_head, 1.0f, 1.0f);  // dWhead += dlogits^T xf
  hs.logits = Tensor();
  Tensor dx = Tensor::empty({T, c.hidden_size}, hs.xf.dtype(), MemCategory::kActivations);
  be.rmsnorm_backward(hs.x_last, w.final_norm, hs.rstd, d_xf, dx, g.final_norm);
  hs = HeadSaved();
  d_xf = Tensor();

  for (size_t l = L; l-- > 0;) {
    if (!keep) {
      const Tensor x_in = saved[l].x_in;
      Tensor out = block_forward(k.ctx, w.layers[l], x_in, &saved[l]);
    }
    dx = block_backward(k.ctx, w.layers[l], saved[l], dx, g.layers[l]);
    saved[l] = BlockSaved();
  }
  be.embedding_backward(batch.input_ids.reshape({T}), dx, 0, g.embed);
  return result;
}

}  // namespace foldpar
