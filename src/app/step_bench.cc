// Single-rank step timing.
#include "app/step_bench.h"

#include <sys/resource.h>

#include <memory>

#include "app/synthetic.h"
#include "backend/backend.h"
#include "backend/bf16_storage_backend.h"
#include "core/timing.h"
#include "model/flop_count.h"

namespace foldpar {

Result<StepBenchReport> run_step_bench(const StepBenchOptions& o) {
  FP_RETURN_IF_ERROR(o.config.validate());
  if (o.batch <= 0 || o.seq <= 0 || o.steps <= 0 || o.warmup < 0)
    return invalid_argument("bench: batch ({}), seq ({}) and steps ({}) must be positive, warmup ({}) not negative",
                            o.batch, o.seq, o.steps, o.warmup);
  MemoryTracker::process().reset_peaks();
  LlamaWeights w = LlamaWeights::allocate(o.config, o.bf16 ? DType::kBF16 : DType::kF32, MemCategory::kParameters);
  init_weights(InitOptions{.seed = o.seed}, w);
  LlamaWeights g = LlamaWeights::allocate(o.config, DType::kF32, MemCategory::kGradients);
  const Batch batch = synthetic_batch(o.config, o.batch, o.seq, o.seed + 1);
  std::unique_ptr<Backend> cpu = o.backend != nullptr ? nullptr : make_cpu_backend();
  Backend& inner = o.backend != nullptr ? *o.backend : *cpu;
  // bf16 storage over the CPU backend, as the trainer does; a borrowed backend (CUDA) runs
  // bf16 natively.
  std::unique_ptr<Backend> bf16 = o.bf16 && o.backend == nullptr ? make_bf16_storage_backend(inner) : nullptr;
  Backend& base = bf16 ? *bf16 : inner;
  TimedBackend timed(base);
  Backend& be = o.profile ? static_cast<Backend&>(timed) : base;
  StepOptions step;
  step.recompute = o.recompute;

  std::vector<Tensor*> grads;
  g.for_each([&](const std::string&, Tensor& t) { grads.push_back(&t); });

  StepBenchReport r;
  for (int i = 0; i < o.warmup + o.steps; ++i) {
    be.fill_many(0.0, grads);  // through the backend: one launch on a GPU
    if (i == o.warmup) timed.reset();
    const double t0 = now_seconds();
    FP_ASSIGN_OR_RETURN(StepResult res, model_forward_backward(o.config, be, w, batch, step, g));
    const double dt = now_seconds() - t0;
    if (i >= o.warmup) r.step_seconds.push_back(dt);
    r.loss = res.loss;
  }
  r.median_seconds = median(r.step_seconds);
  r.tokens_per_second = static_cast<double>(o.batch * o.seq) / r.median_seconds;
  r.flops_per_step = train_step_flops(o.config, o.batch, o.seq);
  r.gflops = r.flops_per_step / r.median_seconds / 1e9;
  r.memory = MemoryTracker::process().stats();
  r.op_times = timed.times();
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  r.peak_rss_bytes = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  return r;
}

}  // namespace foldpar
