// AdamW, schedule and clipping.
#include "train/optimizer.h"

#include <cmath>
#include <numbers>

namespace foldpar {

Status OptimizerConfig::validate() const {
  if (!(lr > 0) || !(min_lr >= 0) || min_lr > lr)
    return invalid_argument("learning rates must satisfy 0 <= min_lr ({}) <= lr ({}) and lr > 0", min_lr, lr);
  if (warmup_steps < 0 || total_steps <= 0)
    return invalid_argument("warmup steps ({}) must not be negative and total steps ({}) must be positive",
                            warmup_steps, total_steps);
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    return invalid_argument("AdamW betas ({}, {}) must lie in [0, 1)", beta1, beta2);
  if (!(eps > 0) || !(weight_decay >= 0) || !(grad_clip >= 0))
    return invalid_argument("eps ({}) must be positive, weight decay ({}) and gradient clip ({}) not negative", eps,
                            weight_decay, grad_clip);
  return Status();
}

double learning_rate(const OptimizerConfig& c, int64_t step) {
  if (c.warmup_steps > 0 && step <= c.warmup_steps)
    return c.lr * static_cast<double>(step) / static_cast<double>(c.warmup_steps);
  const double span = static_cast<double>(std::max<int64_t>(1, c.total_steps - c.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - c.warmup_steps) / span);
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

double clip_scale(double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0;
  return max_norm / norm;
}

AdamW::AdamW(std::vector<ParamRef> params, const OptimizerConfig& config)
    : params_(std::move(params)), config_(config) {
  for (const ParamRef& p : params_) {
    m_.push_back(Tensor::zeros(p.param.shape(), DType::kF32, MemCategory::kOptimizer));
    v_.push_back(Tensor::zeros(p.param.shape(), DType::kF32, MemCategory::kOptimizer));
    // Not a step path: the f32 master copy is made once, when the optimizer is built.
    master_.push_back(p.param.dtype() == DType::kF32 ? Tensor() : p.param.to(DType::kF32, MemCategory::kOptimizer));
  }
}

std::vector<ParamRef> AdamW::checkpoint_params() const {
  std::vector<ParamRef> refs = params_;
  for (size_t i = 0; i < refs.size(); ++i)
    if (master_[i].defined()) refs[i].param = master_[i];
  return refs;
}

void AdamW::sync_params(Backend& be) {
  for (size_t i = 0; i < params_.size(); ++i)
    if (master_[i].defined()) be.copy(master_[i], params_[i].param);
}

void AdamW::step(Backend& be, double lr, double clip) {
  ++steps_;
  Backend::AdamWStep s;
  s.lr = lr;
  s.beta1 = config_.beta1;
  s.beta2 = config_.beta2;
  s.eps = config_.eps;
  s.weight_decay = config_.weight_decay;  // where ParamRef::decay (AdamWTensors::decay)
  s.grad_scale = clip;
  s.step = steps_;
  // One call for every parameter, the bf16 parameters' rounding from their masters included:
  // one launch on the CUDA backend instead of one per tensor (and one copy per bf16 tensor).
  std::vector<Backend::AdamWTensors> ts(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const bool master = master_[i].defined();
    ts[i] = {&params_[i].grad, master ? &master_[i] : &params_[i].param, &m_[i], &v_[i], params_[i].decay,
             master ? &params_[i].param : nullptr};
  }
  be.adamw_update_many(s, ts);
}

}  // namespace foldpar
