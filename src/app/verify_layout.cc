// verify --layout: a parallel layout against the single-rank model from the same seed.
// Every rank computes the single-rank reference itself (verification sizes are small), runs
// its part of the parallel step, and compares its logits rows and the gradients assembled
// from every rank's shards. Memory peaks and counted traffic are those of the parallel
// step alone (measured before the reference allocates anything).
#include <cmath>

#include "app/verify.h"
#include "app/verify_common.h"
#include "comm/comm_stats.h"
#include "comm/mesh.h"
#include "parallel/make_layout.h"
#include "core/timing.h"
#include "core/tolerance.h"
#include "tensor/compare.h"

namespace foldpar {
namespace {

// Every rank's value, in world order.
std::vector<int64_t> gather_i64(Communicator& world, int64_t value) {
  std::vector<int64_t> all(static_cast<size_t>(world.size()));
  FP_CHECK_OK(world.all_gather(&value, all.data(), 1, DType::kI64));
  return all;
}

}  // namespace

Result<VerifyReport> run_verify_layout(const VerifyOptions& o, Communicator& world) {
  using namespace verify_detail;
  FP_RETURN_IF_ERROR(o.config.validate());
  if (o.batch <= 0 || o.seq <= 0) return invalid_argument("--batch ({}) and --seq ({}) must be positive", o.batch, o.seq);
  FP_CHECK(o.layout.has_value(), "run_verify_layout without a layout");
  Layout lo = *o.layout;
  lo.recompute = o.recompute;
  // verify holds the layout to the f32 single-rank model at f32 tolerances; bf16 storage
  // is held to the f32 run's losses by `train --bf16` (tests/e2e/train_bf16.sh).
  if (lo.dtype == DType::kBF16)
    return invalid_argument("verify compares {} with the f32 single-rank model to {:g}; bf16 storage cannot meet "
                            "that: drop :bf16 (train --bf16 checks bf16 against f32)",
                            lo.to_string(), o.tolerance > 0 ? o.tolerance : tol::kF32Parallel);
  // verify gives every dp replica the whole batch (the replicas are copies); a MoE model sums
  // its routing statistics over dp (the global batch's aux loss, tsp_model.h), which copies
  // would count R times. dp with MoE is held to one rank by tsp_moe_parity_test instead.
  if (lo.dp > 1 && o.config.moe.enabled())
    return unimplemented("verify runs every dp replica on the whole batch, which a mixture-of-experts model's aux "
                         "loss (summed over the {} replicas) does not allow: verify {} without dp",
                         lo.dp, lo.to_string());
  FP_ASSIGN_OR_RETURN(Mesh mesh, Mesh::create(world, lo.mesh()));
  lo.keep_logits = true;
  const Batch global = verify_batch(o);
  auto be = make_cpu_backend();
  // The parallel step is measured on its own, from before its weights exist.
  MemoryTracker& mt = MemoryTracker::process();
  const int64_t parallel_base = mt.stats().current_total;
  mt.reset_peaks();
  FP_ASSIGN_OR_RETURN(std::unique_ptr<ShardedModel> model, make_sharded_model(o.config, mesh, o.seq, lo));
  const Batch local = model->local_batch(global);

  VerifyReport r;
  r.layout = model->layout();
  r.tolerance = o.tolerance > 0 ? o.tolerance : tol::kF32Parallel;
  const InitOptions init{.seed = o.seed, .std = 0.02, .norm_jitter = 0.1};
  model->init_weights(init);
  ScopedCommCounter counter(mesh.communicators());
  double t0 = now_seconds();
  FP_ASSIGN_OR_RETURN(StepResult got, model->forward_backward(*be, local, 0));
  r.fast_seconds = now_seconds() - t0;
  const int64_t parallel_peak = mt.stats().peak_total - parallel_base;
  const OpCounters moved = counter.delta().total();
  LlamaWeights assembled = LlamaWeights::allocate(o.config, DType::kF32, MemCategory::kGradients);
  FP_RETURN_IF_ERROR(model->assemble_grads(assembled));
  Tensor global_logits = Tensor::empty({o.batch, o.seq, o.config.vocab_size}, DType::kF32, MemCategory::kWorkspace);
  FP_RETURN_IF_ERROR(model->assemble_logits(got.logits, global_logits));
  model.reset();

  // ---- the single-rank reference ----
  const int64_t base = mt.stats().current_total;
  mt.reset_peaks();
  const LlamaWeights w = verify_weights(o);
  LlamaWeights ref_g = LlamaWeights::allocate(o.config, DType::kF32, MemCategory::kGradients);
  ref_g.zero();
  StepOptions so;
  so.recompute = o.recompute;
  so.keep_logits = true;
  t0 = now_seconds();
  FP_ASSIGN_OR_RETURN(StepResult ref, model_forward_backward(o.config, *be, w, global, so, ref_g));
  r.reference_seconds = now_seconds() - t0;
  r.single_rank_peak_bytes = mt.stats().peak_total - base;

  // ---- compare: loss, every rank's logits, every gradient ----
  r.loss = got.loss;
  r.loss_reference = ref.loss;
  r.valid_tokens = got.valid_tokens;
  r.errors.push_back({"loss", std::abs(got.loss - ref.loss) / std::max(std::abs(ref.loss), 1e-30)});
  r.errors.push_back({"logits", max_rel_error(global_logits, ref.logits)});
  add_gradient_errors(assembled, ref_g, r);
  finish_report(r);
  r.peak_bytes = gather_i64(world, parallel_peak);
  r.bytes_sent = gather_i64(world, static_cast<int64_t>(moved.bytes_sent));
  r.bytes_received = gather_i64(world, static_cast<int64_t>(moved.bytes_received));
  if (!o.dump_dir.empty() && world.rank() == 0)
    FP_RETURN_IF_ERROR(write_dump(o, w, global, assembled, global_logits, got.loss, got.valid_tokens));
  return r;
}

}  // namespace foldpar
