// AdamW over the parameters a rank holds (its own shards only: no collective), with the
// learning-rate schedule (linear warmup, then cosine decay to a floor) and global gradient
// clipping. Optimizer state is f32, counted under MemCategory::kOptimizer; a parameter
// stored in bf16 gets an f32 master copy there too: the update runs on the master, and the
// bf16 parameter is the master rounded after every step.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "parallel/param_ref.h"

namespace foldpar {

struct OptimizerConfig {
  double lr = 3e-4;            // peak learning rate
  double min_lr = 3e-5;        // floor of the cosine decay
  int64_t warmup_steps = 20;   // linear warmup from lr / warmup_steps
  int64_t total_steps = 1000;  // the cosine reaches min_lr here
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;   // not applied to norm gains (ParamRef::decay)
  double grad_clip = 1.0;      // clip the global gradient norm to this; 0 disables

  Status validate() const;
};

// Learning rate of 1-based step `step`.
double learning_rate(const OptimizerConfig& c, int64_t step);

class AdamW {
 public:
  AdamW(std::vector<ParamRef> params, const OptimizerConfig& config);

  // One step with learning rate `lr`, gradients multiplied by clip_scale. With bf16
  // parameters `backend` must accept bf16 storage (backend/bf16_storage_backend.h).
  void step(Backend& backend, double lr, double clip_scale);
  // The parameters as checkpoints see them: each bf16 parameter replaced by its f32 master.
  std::vector<ParamRef> checkpoint_params() const;
  // After masters were loaded (from a checkpoint): round them into the bf16 parameters.
  void sync_params(Backend& backend);

  const std::vector<ParamRef>& params() const { return params_; }
  // Moments, one per parameter, same shapes (checkpoints read and write them).
  std::vector<Tensor>& first_moments() { return m_; }
  std::vector<Tensor>& second_moments() { return v_; }
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t steps) { steps_ = steps; }

 private:
  std::vector<ParamRef> params_;
  OptimizerConfig config_;
  std::vector<Tensor> m_, v_;
  std::vector<Tensor> master_;  // f32 masters of bf16 parameters (undefined for f32 ones)
  int64_t steps_ = 0;
};

// The factor that brings a gradient of norm `norm` to at most `max_norm` (1 when within, or
// when max_norm is 0).
double clip_scale(double norm, double max_norm);

}  // namespace foldpar
