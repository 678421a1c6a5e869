// Single-device Llama forward and backward: the blocks of llama_block.cc and the head of
// lm_head.cc in the step order of step_order.cc.
#include "model/llama_model.h"

#include <numeric>
#include <vector>

#include "backend/bf16_storage_backend.h"
#include "backend/rope_table.h"
#include "model/llama_block.h"
#include "model/lm_head.h"
#include "model/moe_layer.h"
#include "model/step_order.h"

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
  std::vector<int32_t> positions(static_cast<size_t>(S));
  std::iota(positions.begin(), positions.end(), 0);
  k.positions = Tensor::empty({S}, DType::kI32, MemCategory::kActivations);
  be.copy_from_host(std::as_bytes(std::span<const int32_t>(positions)), k.positions);
  k.rope_table = build_rope_table(be, positions, c.rope_spec(), S, stat_dtype(dtype));
  k.ctx = BlockContext{&c, &be, batch.batch(), S, &k.positions, &k.rope_table};
}

// The single-rank parts of one step over full weights: the reference ModelStep.
class SingleRankStep final : public ModelStep {
 public:
  SingleRankStep(const LlamaConfig& c, Backend& be, const LlamaWeights& w, const Batch& batch,
                 const StepOptions& options, LlamaWeights* grads)
      : c_(c), be_(be), w_(w), batch_(batch), options_(options), g_(grads), saved_(w.layers.size()),
        aux_(c.moe.num_experts, c.moe.sparse_layer_count(c.num_hidden_layers)) {
    make_constants(c, be, batch, w.embed.dtype(), k_);
    k_.ctx.moe_aux = &aux_;
  }

  Tensor embed_forward() override {
    Tensor x = Tensor::empty({rows(), c_.hidden_size}, w_.embed.dtype(), MemCategory::kActivations);  // [T, h]
    be_.embedding_forward(batch_.input_ids.reshape({rows()}), w_.embed, 0, x);
    return x;
  }

  Tensor block_forward(int64_t l, const Tensor& x, bool save) override {
    return foldpar::block_forward(k_.ctx, w_.layers[l], x, save ? &saved_[l] : nullptr);
  }

  StepResult head_forward(const Tensor& x, bool save) override {
    const LossSums sums = foldpar::head_forward(k_.ctx, head(w_), x, targets(), kIgnoreIndex, hs_);
    StepResult r;
    r.loss_sum = sums.loss_sum;
    r.valid_tokens = sums.valid_tokens;
    r.loss = r.valid_tokens > 0 ? r.loss_sum / static_cast<double>(r.valid_tokens) : 0.0;
    if (c_.moe.enabled()) {
      r.aux_loss = aux_.loss(c_.moe.aux_per_layer);
      r.expert_load = aux_.load();
      r.moe_dropped = aux_.dropped_pairs();
      if (c_.moe.output_router_logits) r.loss += c_.moe.router_aux_loss_coef * r.aux_loss;
    }
    // The backward overwrites the logits in place: keep a copy then.
    if (options_.keep_logits)
      r.logits = (save ? hs_.logits.clone(MemCategory::kActivations) : hs_.logits)
                     .reshape({batch_.batch(), batch_.seq(), c_.vocab_size});
    return r;
  }

  // Backward of loss = loss_sum / n (+ the aux term times valid_tokens / n), n the
  // normalizer (valid_tokens unless accumulating).
  Tensor head_backward(const StepResult& r) override {
    const int64_t n = options_.loss_normalizer > 0 ? options_.loss_normalizer : r.valid_tokens;
    const double grad_scale = n > 0 ? 1.0 / static_cast<double>(n) : 0.0;
    HeadWeights g = head(*g_);
    if (c_.moe.enabled() && c_.moe.output_router_logits) {
      const double share = n > 0 ? static_cast<double>(r.valid_tokens) / static_cast<double>(n) : 1.0;
      prob_grad_ = aux_.prob_grad(c_.moe.router_aux_loss_coef * share, c_.moe.aux_per_layer);
      k_.ctx.moe_prob_grad = &prob_grad_;
    }
    Tensor dx = foldpar::head_backward(k_.ctx, head(w_), hs_, targets(), kIgnoreIndex, grad_scale, g);
    hs_ = HeadSaved();
    return dx;
  }

  Tensor block_backward(int64_t l, Tensor dx) override {
    Tensor dx_in = foldpar::block_backward(k_.ctx, w_.layers[l], saved_[l], dx, g_->layers[l]);
    saved_[l] = BlockSaved();
    return dx_in;
  }

  void embed_backward(const Tensor& dx) override {
    be_.embedding_backward(batch_.input_ids.reshape({rows()}), dx, 0, g_->embed);
  }

 private:
  static HeadWeights head(const LlamaWeights& w) { return HeadWeights{w.final_norm, w.lm_head}; }
  int64_t rows() const { return batch_.batch() * batch_.seq(); }
  Tensor targets() const { return batch_.target_ids.reshape({rows()}); }

  const LlamaConfig& c_;
  Backend& be_;
  const LlamaWeights& w_;
  const Batch& batch_;
  const StepOptions& options_;
  LlamaWeights* g_;  // null for a forward only
  StepConstants k_;
  std::vector<BlockSaved> saved_;  // per layer
  HeadSaved hs_;
  MoeAux aux_;                     // MoE routing statistics of this step
  std::vector<std::vector<double>> prob_grad_;  // [sparse layers][E] the aux loss's gradient on p
};

}  // namespace

Status validate_batch(Backend& be, const LlamaConfig& c, const Batch& batch) {
  const Tensor &ids = batch.input_ids, &tg = batch.target_ids;
  if (ids.rank() != 2 || ids.dtype() != DType::kI32 || tg.shape() != ids.shape() || tg.dtype() != DType::kI32)
    return invalid_argument("batch: input_ids {} and target_ids {} must both be i32 [B, S]", ids.describe(),
                            tg.describe());
  if (batch.batch() <= 0 || batch.seq() <= 0)
    return invalid_argument("batch: B ({}) and S ({}) must be positive", batch.batch(), batch.seq());
  // The ids are checked on the host: they come out through the backend.
  std::vector<int32_t> host_ids(static_cast<size_t>(ids.numel())), host_tg(static_cast<size_t>(tg.numel()));
  be.copy_to_host(ids, std::as_writable_bytes(std::span<int32_t>(host_ids)));
  be.copy_to_host(tg, std::as_writable_bytes(std::span<int32_t>(host_tg)));
  for (size_t i = 0; i < host_ids.size(); ++i) {
    const int32_t id = host_ids[i], t = host_tg[i];
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
  FP_RETURN_IF_ERROR(validate_batch(be, c, batch));
  SingleRankStep step(c, be, w, batch, options, nullptr);
  return step_forward(step, static_cast<int64_t>(w.layers.size()));
}

Result<StepResult> model_forward_backward(const LlamaConfig& c, Backend& be, const LlamaWeights& w,
                                          const Batch& batch, const StepOptions& options, LlamaWeights& g) {
  FP_RETURN_IF_ERROR(validate_batch(be, c, batch));
  SingleRankStep step(c, be, w, batch, options, &g);
  return step_forward_backward(step, static_cast<int64_t>(w.layers.size()), options.recompute);
}

}  // namespace foldpar
