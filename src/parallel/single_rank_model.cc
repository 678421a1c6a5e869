// The single-rank model behind the ShardedModel interface. loss_sum carries the MoE aux
// term (coef * aux * valid tokens, when output_router_logits) so that loss_sum / valid, what
// the trainer reports and validates by, is Hugging Face's loss, as StepResult::loss is.
#include "parallel/single_rank_model.h"

#include <vector>

#include "parallel/sharded_weights.h"

namespace foldpar {
namespace {

class SingleRankModel final : public ShardedModel {
 public:
  SingleRankModel(const LlamaConfig& c, const Layout& layout)
      : c_(c),
        layout_(layout.to_string()),
        recompute_(layout.recompute),
        keep_logits_(layout.keep_logits),
        w_(LlamaWeights::allocate(c, layout.dtype, MemCategory::kParameters)),
        g_(LlamaWeights::allocate(c, DType::kF32, MemCategory::kGradients)) {}

  const std::string& layout() const override { return layout_; }
  Batch local_batch(const Batch& global) const override { return global; }
  void init_weights(const InitOptions& options) override { foldpar::init_weights(options, w_); }
  void zero_grads(Backend& be) override {
    std::vector<Tensor*> grads;
    g_.for_each([&](const std::string&, Tensor& t) { grads.push_back(&t); });
    be.fill_many(0.0, grads);  // one launch on the CUDA backend
  }

  // Micro-batches (loss_normalizer the step's valid tokens): each one's aux loss over its own
  // rows, weighted by its share of the step's valid tokens (docs/design.md, "Mixture of experts").
  Result<StepResult> forward_backward(Backend& be, const Batch& local, int64_t loss_normalizer) override {
    StepOptions o;
    o.recompute = recompute_;
    o.keep_logits = keep_logits_;
    o.loss_normalizer = loss_normalizer;
    FP_ASSIGN_OR_RETURN(StepResult r, model_forward_backward(c_, be, w_, local, o, g_));
    return with_aux_in_sum(std::move(r));
  }

  Result<StepResult> forward(Backend& be, const Batch& local) override {
    StepOptions o;
    o.keep_logits = keep_logits_;
    FP_ASSIGN_OR_RETURN(StepResult r, model_forward(c_, be, w_, local, o));
    return with_aux_in_sum(std::move(r));
  }

  std::vector<ParamRef> parameters() override { return replicated_param_refs(w_, g_, true); }

  // Not step paths: full tensors copied on the host.
  Status assemble_weights(LlamaWeights& global) override { return copy_all(w_, global); }
  Status assemble_grads(LlamaWeights& global) override { return copy_all(g_, global); }
  Status assemble_logits(const Tensor& local, Tensor& global) override {
    global.copy_from(local);
    return Status();
  }

 private:
  StepResult with_aux_in_sum(StepResult r) const {
    if (c_.moe.enabled() && c_.moe.output_router_logits)
      r.loss_sum += c_.moe.router_aux_loss_coef * r.aux_loss * static_cast<double>(r.valid_tokens);
    return r;
  }

  // Converted where the dtypes differ (bf16 weights into the caller's f32 tensors).
  static Status copy_all(LlamaWeights& from, LlamaWeights& to) {
    std::vector<Tensor> src;
    from.for_each([&](const std::string&, Tensor& t) { src.push_back(t); });
    size_t i = 0;
    to.for_each([&](const std::string&, Tensor& t) {
      const Tensor& s = src[i++];
      t.copy_from(s.dtype() == t.dtype() ? s : s.to(t.dtype(), MemCategory::kWorkspace));
    });
    return Status();
  }

  const LlamaConfig c_;
  std::string layout_;
  Recompute recompute_;
  bool keep_logits_;
  LlamaWeights w_, g_;
};

}  // namespace

Result<std::unique_ptr<ShardedModel>> make_single_rank_model(const LlamaConfig& config, const Layout& layout) {
  return std::unique_ptr<ShardedModel>(new SingleRankModel(config, layout));
}

}  // namespace foldpar
