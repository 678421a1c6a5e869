// PipelineModel: the stage's weights, the pipelined step (1F1B, interleaved or ZB-H1) over
// the stage strategy's ModelSteps, the loss and tied-embedding sums between stages, and
// assembly over pp.
#include "parallel/pipeline/pipeline_model.h"

#include <algorithm>

#include "model/moe_layer.h"
#include "model/weight_grad_queue.h"
#include "parallel/moe_dispatch.h"
#include "parallel/pipeline/pipeline_schedule.h"
#include "parallel/strategies.h"

namespace foldpar {

Result<std::unique_ptr<PipelineModel>> PipelineModel::create(const LlamaConfig& config, Communicator& pp,
                                                             std::unique_ptr<StageStrategy> stage,
                                                             const Layout& layout) {
  FP_RETURN_IF_ERROR(validate_layout(config, layout, 0, 0));
  if (pp.size() != layout.pp)
    return invalid_argument("layout {} has {} pipeline stages, the pp communicator {} ranks", layout.to_string(),
                            layout.pp, pp.size());
  const std::vector<int64_t> bounds = stage_bounds(config, layout);  // [p v + 1]
  const int s = pp.rank();
  StageLayers layers{bounds[s], bounds[s + 1], s == 0, s == layout.pp - 1, {}};
  if (layout.chunks > 1)  // interleaved: global chunks s, s + p, ...
    for (size_t g = static_cast<size_t>(s); g + 1 < bounds.size(); g += static_cast<size_t>(layout.pp))
      layers.chunks.emplace_back(bounds[g], bounds[g + 1]);
  return std::unique_ptr<PipelineModel>(new PipelineModel(config, pp, std::move(stage), layout, layers));
}

PipelineModel::PipelineModel(const LlamaConfig& config, Communicator& pp, std::unique_ptr<StageStrategy> stage,
                             const Layout& layout, StageLayers layers)
    : config_(config),
      pp_(pp),
      stage_(std::move(stage)),
      layout_(layout),
      name_(layout.to_string()),
      stage_index_(pp.rank()),
      stages_(pp.size()),
      layers_(layers),
      weights_(ShardedWeights::allocate(config, stage_->dims(), stage_->weight_axis().rank(), layout.dtype,
                                        MemCategory::kParameters, layers)),
      grads_(ShardedGrads::allocate(config, stage_->dims(), stage_->weight_axis().rank(), MemCategory::kGradients,
                                    layers)) {
  weights_.expert_rank = stage_->expert_rank();
  grads_.views().expert_rank = stage_->expert_rank();
}

Result<StepResult> PipelineModel::forward_backward(Backend& be, const Batch& local, int64_t loss_normalizer) {
  return run_schedule(be, {local}, loss_normalizer);
}

Result<StepResult> PipelineModel::forward_backward_micro_batches(Backend& be, const std::vector<Batch>& locals,
                                                                 int64_t loss_normalizer) {
  FP_RETURN_IF_ERROR(validate_micro_batches(layout_, static_cast<int64_t>(locals.size())));
  return run_schedule(be, locals, loss_normalizer);
}

std::vector<PipelineOp> PipelineModel::schedule(int m) const {
  if (layout_.zero_bubble) return zero_bubble_h1(stages_, stage_index_, m);
  if (layout_.chunks > 1) return interleaved_one_f_one_b(stages_, stage_index_, m, layout_.chunks);
  return one_f_one_b(stages_, stage_index_, m);
}

Result<StepResult> PipelineModel::run_schedule(Backend& be, const std::vector<Batch>& locals, int64_t normalizer) {
  const int m = static_cast<int>(locals.size());
  if (m == 0) return invalid_argument("a pipeline step needs at least one micro-batch");
  std::unique_ptr<StageSteps> steps = stage_->begin(be, weights_, &grads_, locals[0].batch());
  // Every micro-batch's step first: a batch that does not fit fails before anything moves.
  std::vector<std::unique_ptr<ModelStep>> mb(static_cast<size_t>(m));
  for (int i = 0; i < m; ++i) {
    FP_ASSIGN_OR_RETURN(mb[i], steps->micro_batch(locals[i], normalizer));
  }
  StepTimer timer;
  const int v = layout_.chunks;
  StageBoundary boundary(pp_, locals[0].input_ids.numel(), config_.hidden_size, layout_.dtype, timer, v);
  configure(boundary);
  const int64_t grad_values = aux_grad_values();
  boundary.set_side(stats_values(), grad_values);
  std::vector<std::vector<Tensor>> inputs(static_cast<size_t>(m));  // Recompute::kBlock: block inputs
  std::vector<StepResult> results(static_cast<size_t>(m));         // last stage
  // ZB-H1: each micro-batch's weight-gradient products between its B and its W.
  std::vector<WeightGradQueue> deferred(layout_.zero_bubble ? static_cast<size_t>(m) : 0);
  deferred_bytes_ = 0;
  const std::vector<PipelineOp> ops = schedule(m);
  for (size_t k = 0; k < ops.size(); ++k) {
    boundary.progress();
    const int i = ops[k].micro_batch, c = ops[k].chunk;
    const auto [first, end] = chunk_layers(c);
    ModelStep& step = *mb[i];
    if (ops[k].kind == PipelineOp::Kind::kForward) {
      inputs[i].resize(static_cast<size_t>(config_.num_hidden_layers));
      Tensor stats;  // MoE: the routing statistics of the chunks before
      Tensor x = boundary.first_chunk(c) ? step.embed_forward() : boundary.take_activation(i, c, &stats);
      if (stats.defined()) step.set_routing_stats(to_host(be, stats));
      x = forward_blocks_saving(step, first, end, std::move(x), layout_.recompute, inputs[i]);
      if (boundary.last_chunk(c)) results[i] = step.head_forward(x, true);
      else boundary.send_activation(i, std::move(x), c, side(be, step.routing_stats()));
    } else if (ops[k].kind == PipelineOp::Kind::kBackward) {
      Tensor aux_grad;  // MoE: the aux loss's gradient from the last stage
      Tensor dx = boundary.last_chunk(c) ? step.head_backward(results[i]) : boundary.take_gradient(i, c, &aux_grad);
      if (aux_grad.defined()) step.set_aux_prob_grad(to_host(be, aux_grad));
      // ZB-H1's B: the blocks' input gradients only (validate_layout admits the stages that split).
      if (layout_.zero_bubble) {
        FP_CHECK(step.defer_weight_grads(&deferred[i]), "{}: this stage's weight gradients cannot be deferred",
                 name_);
      }
      dx = backward_blocks(step, first, end, std::move(dx), layout_.recompute, inputs[i]);
      if (layout_.zero_bubble) {
        step.defer_weight_grads(nullptr);
        deferred_bytes_ = std::max(deferred_bytes_, deferred[i].held_bytes());
      }
      if (boundary.first_chunk(c)) step.embed_backward(dx);
      else boundary.send_gradient(i, std::move(dx), c, grad_values > 0 ? side(be, step.aux_prob_grad()) : Tensor());
      if (c == 0 && !layout_.zero_bubble) finish_micro_batch(*steps, mb[i], inputs[i]);
    } else {  // ZB-H1's W: the deferred products, then the micro-batch is done
      deferred[i].run(be);
      finish_micro_batch(*steps, mb[i], inputs[i]);
    }
    // The receive the next F or B needs (W moves nothing), posted together with the send just
    // started; posting it again later is a no-op.
    for (size_t n = k + 1; n < ops.size(); ++n) {
      const PipelineOp& next = ops[n];
      if (next.kind == PipelineOp::Kind::kWeight) continue;
      if (next.kind == PipelineOp::Kind::kForward) boundary.post_activation_recv(next.micro_batch, next.chunk);
      else boundary.post_gradient_recv(next.micro_batch, next.chunk);
      break;
    }
  }
  boundary.finish();
  steps->finish_backward();
  sum_tied_embedding(be);
  grads_.mark_written();
  StepResult r = share_loss(results);
  r.exposed_comm_seconds = timer.seconds() + steps->wait_seconds();
  if (m == 1) r.logits = results[0].logits;  // keep_logits, last stage: this rank's rows
  return r;
}

void PipelineModel::finish_micro_batch(StageSteps& steps, std::unique_ptr<ModelStep>& step,
                                       std::vector<Tensor>& inputs) {
  steps.finish_micro_batch(*step);
  step.reset();  // the micro-batch's saved state
  inputs.clear();
}

Result<StepResult> PipelineModel::forward(Backend& be, const Batch& local) {
  std::unique_ptr<StageSteps> steps = stage_->begin(be, weights_, nullptr, local.batch());
  FP_ASSIGN_OR_RETURN(std::unique_ptr<ModelStep> step, steps->micro_batch(local, 0));
  StepTimer timer;
  const int v = layout_.chunks;
  StageBoundary boundary(pp_, local.input_ids.numel(), config_.hidden_size, layout_.dtype, timer, v);
  configure(boundary);
  boundary.set_side(stats_values(), 0);
  StepResult last;
  for (int c = 0; c < v; ++c) {  // chunk c of every rank, then chunk c + 1
    Tensor stats;
    Tensor x = boundary.first_chunk(c) ? step->embed_forward() : boundary.take_activation(0, c, &stats);
    if (stats.defined()) step->set_routing_stats(to_host(be, stats));
    const auto [first, end] = chunk_layers(c);
    for (int64_t l = first; l < end; ++l) x = step->block_forward(l, x, false);
    if (boundary.last_chunk(c)) last = step->head_forward(x, false);
    else boundary.send_activation(0, std::move(x), c, side(be, step->routing_stats()));
  }
  boundary.finish();
  StepResult r = share_loss({last});
  r.exposed_comm_seconds = timer.seconds() + steps->wait_seconds();
  r.logits = last.logits;
  return r;
}

void PipelineModel::configure(StageBoundary& boundary) {
  Communicator& axis = stage_->weight_axis();
  boundary.set_place({axis.name().c_str(), axis.rank()});
  boundary.set_hooks(&hooks_);
}

int64_t PipelineModel::stats_values() const {
  const MoeConfig& m = config_.moe;
  return m.enabled() ? MoeAux(m.num_experts, m.sparse_layer_count(config_.num_hidden_layers)).packed_size() : 0;
}

int64_t PipelineModel::aux_grad_values() const {
  const MoeConfig& m = config_.moe;
  return m.enabled() && m.output_router_logits ? m.num_experts * m.sparse_layer_count(config_.num_hidden_layers) : 0;
}

Tensor PipelineModel::side(Backend& be, const std::vector<double>& values) {
  return values.empty() ? Tensor() : moe_comm_from_host(be, values, DType::kF64);
}

std::vector<double> PipelineModel::to_host(Backend& be, const Tensor& t) {
  std::vector<double> v;
  moe_comm_to_host(be, t, v);
  return v;
}

StepResult PipelineModel::share_loss(const std::vector<StepResult>& results) {
  // Host scalars: loss_sum and the valid targets; a MoE model's aux loss times the valid
  // targets, the expert load [E] and the dropped pairs too (as
  // ShardedModel::forward_backward_micro_batches sums them). loss_sum carries the aux term
  // as the single-rank model's does (single_rank_model.cc): coef x each micro-batch's aux
  // loss x its valid targets.
  const MoeConfig& moe = config_.moe;
  const size_t E = moe.enabled() ? static_cast<size_t>(moe.num_experts) : 0;
  std::vector<double> sums(moe.enabled() ? 4 + E : 2, 0.0);
  for (const StepResult& r : results) {
    const double valid = static_cast<double>(r.valid_tokens);
    sums[0] += r.loss_sum;
    sums[1] += valid;
    if (!moe.enabled()) continue;
    if (moe.output_router_logits) sums[0] += moe.router_aux_loss_coef * r.aux_loss * valid;
    sums[2] += r.aux_loss * valid;
    for (size_t e = 0; e < r.expert_load.size() && e < E; ++e) sums[3 + e] += static_cast<double>(r.expert_load[e]);
    sums[3 + E] += static_cast<double>(r.moe_dropped);
  }
  if (stages_ > 1) FP_CHECK_OK(pp_.broadcast(sums.data(), sums.size(), DType::kF64, stages_ - 1));
  StepResult r;
  r.loss_sum = sums[0];
  r.valid_tokens = static_cast<int64_t>(sums[1]);
  r.loss = r.valid_tokens > 0 ? r.loss_sum / static_cast<double>(r.valid_tokens) : 0.0;
  if (moe.enabled()) {
    r.aux_loss = r.valid_tokens > 0 ? sums[2] / static_cast<double>(r.valid_tokens) : 0.0;
    for (size_t e = 0; e < E; ++e) r.expert_load.push_back(static_cast<int64_t>(sums[3 + e]));
    r.moe_dropped = static_cast<int64_t>(sums[3 + E]);
  }
  return r;
}

void PipelineModel::sum_tied_embedding(Backend& be) {
  if (!config_.tie_word_embeddings || stages_ == 1 || !(layers_.embed || layers_.head)) return;
  const int peer = layers_.embed ? stages_ - 1 : 0;
  Tensor& g = grads_.views().embed;  // [V/D, h]
  Tensor incoming = Tensor::empty(g.shape(), DType::kF32, MemCategory::kComm);
  FP_CHECK_OK(pp_.send_recv(g.raw_data(), incoming.raw_data(), static_cast<size_t>(g.numel()), DType::kF32, peer, peer));
  be.add_inplace(incoming, g);  // g0 + g_last on both: addition commutes, so the copies agree bit for bit
}

std::vector<ParamRef> PipelineModel::parameters() {
  std::vector<ParamRef> refs =
      sharded_param_refs(weights_, grads_.views(), stage_->counts_replicated(), stage_->counts_sharded());
  // The last stage's copy of a tied embedding: stage 0 speaks for it.
  if (config_.tie_word_embeddings && stages_ > 1 && !layers_.embed)
    for (ParamRef& r : refs)
      if (r.name == "embed") r.counted = false;
  return refs;
}

Status PipelineModel::assemble(const ShardedWeights& shard, LlamaWeights& global) {
  FP_RETURN_IF_ERROR(assemble_global(shard, stage_->weight_axis(), global));
  // Experts spread wider than the weight axis: each weight-axis group holds its own.
  FP_RETURN_IF_ERROR(sum_experts_across(stage_->expert_across(), global));
  // Host-side assembly: each element from the one stage that holds it (the tied embedding from stage 0).
  if (config_.tie_word_embeddings && !layers_.embed) global.embed.zero();
  Status status;
  global.for_each([&](const std::string&, Tensor& t) {
    if (status.ok())
      status = pp_.all_reduce(t.raw_data(), t.raw_data(), static_cast<size_t>(t.numel()), DType::kF32, ReduceOp::kSum);
  });
  return status;
}

Status PipelineModel::assemble_logits(const Tensor& local, Tensor& global) {
  // The last stage's rows over its weight axis, then to every stage.
  if (layers_.head) {
    FP_RETURN_IF_ERROR(stage_->assemble_logits(local, global));
  }
  if (stages_ == 1) return Status();
  return pp_.broadcast(global.raw_data(), static_cast<size_t>(global.numel()), DType::kF32, stages_ - 1);
}

Result<std::unique_ptr<ShardedModel>> make_pipeline_model(const LlamaConfig& config, Communicator& pp,
                                                          std::unique_ptr<StageStrategy> stage, const Layout& layout) {
  FP_ASSIGN_OR_RETURN(std::unique_ptr<PipelineModel> model, PipelineModel::create(config, pp, std::move(stage), layout));
  return std::unique_ptr<ShardedModel>(std::move(model));
}

}  // namespace foldpar
