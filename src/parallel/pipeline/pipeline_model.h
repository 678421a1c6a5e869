// PipelineModel: a Llama model under pipeline parallelism over the pp axis, each stage
// running its layers with a model-axis strategy (parallel/stage_strategy.h: tsp/'s step
// pieces), behind ShardedModel (docs/composition.md section 2). Stage s = pp.rank() holds decoder
// layers [bounds[s], bounds[s+1]) (layout/stage_bounds), the embedding on stage 0 and the
// final norm + LM head on stage p-1, under their global names, so checkpoints are
// layout-independent.
//
// One step of m micro-batches runs the 1F1B schedule (pipeline_schedule.h), with
// Layout::zero_bubble ZB-H1 (each backward's weight-gradient products queued by the stage's
// ModelStep and run later, as the schedule's W op), or with Layout::chunks = v > 1 the
// interleaved one: rank s then holds chunks s, s + p, ... of the p v
// (the embedding with chunk 0, the head with the last; stage_bounds); the boundary
// moves each TSP rank's [B*S/D, h] rows to the same TSP index of the next stage and the
// gradient back (pipeline_boundary.h). The loss is computed on the last stage with the
// caller's normalizer (the valid targets of the whole global batch) and broadcast over pp, so
// every rank returns the same StepResult. With tied embeddings the two end stages' copies of
// the embedding gradient are summed between them (one exchange of the V/D x h shard), so both
// copies stay equal bit for bit; stage 0 speaks for the tensor (ParamRef::counted). A MoE
// model's routing statistics travel with each micro-batch's activation and the aux loss's
// gradient with its gradient (ModelStep::routing_stats / aux_prob_grad, stats_values), so the
// last stage forms the aux loss of every sparse layer and every stage's routers get its
// gradient (docs/composition.md, "MoE under pp").
//
// Collective over the pp communicator and the stage strategy's axis.
#pragma once

#include <memory>

#include "parallel/pipeline/pipeline_boundary.h"
#include "parallel/pipeline/pipeline_schedule.h"
#include "parallel/sharded_model.h"
#include "parallel/stage_strategy.h"

namespace foldpar {

class PipelineModel final : public ShardedModel {
 public:
  // validate_layout's verdict first (pp = layout.pp = pp.size()). Not collective.
  static Result<std::unique_ptr<PipelineModel>> create(const LlamaConfig& config, Communicator& pp,
                                                       std::unique_ptr<StageStrategy> stage, const Layout& layout);

  const std::string& layout() const override { return name_; }
  Batch local_batch(const Batch& global) const override { return stage_->local_batch(global); }
  void init_weights(const InitOptions& options) override { init_sharded_weights(options, weights_); }
  void zero_grads(Backend& backend) override { grads_.zero(backend); }
  // One micro-batch: the schedule with m = 1 (the stages run one after the other); with
  // keep_logits the last stage's result holds its rows' logits.
  Result<StepResult> forward_backward(Backend& backend, const Batch& local, int64_t loss_normalizer) override;
  // m micro-batches in one schedule (the layout's); invalid_argument when m < p (validate_micro_batches).
  Result<StepResult> forward_backward_micro_batches(Backend& backend, const std::vector<Batch>& locals,
                                                    int64_t loss_normalizer) override;
  Result<StepResult> forward(Backend& backend, const Batch& local) override;
  std::vector<ParamRef> parameters() override;
  // Experts over dp replicas: the stage's expert-data replicas (each stage its own).
  Communicator* expert_data_axis() override { return stage_->expert_data_axis(); }
  std::vector<const Communicator*> communicators_beside_mesh() const override {
    return stage_->communicators_beside_mesh();
  }
  // Collective over the weight axis and pp: every rank gets the whole model.
  Status assemble_weights(LlamaWeights& global) override { return assemble(weights_, global); }
  Status assemble_grads(LlamaWeights& global) override { return assemble(grads_.views(), global); }
  // The last stage's logits rows (keep_logits; other stages pass anything) to every rank.
  Status assemble_logits(const Tensor& local, Tensor& global) override;

  int stage() const { return stage_index_; }
  // ZB-H1: the most bytes one micro-batch's deferred weight-gradient products held at the end
  // of its B in the last step (WeightGradQueue::held_bytes); 0 under the other schedules.
  int64_t deferred_bytes() const { return deferred_bytes_; }
  // Fault injection for tests: the boundary calls these in every later step.
  void set_boundary_hooks(BoundaryHooks hooks) { hooks_ = std::move(hooks); }
  const StageLayers& stage_layers() const { return layers_; }
  // Local chunk c's decoder layers [first, end) (interleaved; c = 0: the stage's).
  std::pair<int64_t, int64_t> chunk_layers(int c) const {
    return layers_.chunks.empty() ? std::pair<int64_t, int64_t>{layers_.first, layers_.end} : layers_.chunks[c];
  }

 private:
  PipelineModel(const LlamaConfig& config, Communicator& pp, std::unique_ptr<StageStrategy> stage,
                const Layout& layout, StageLayers layers);
  Result<StepResult> run_schedule(Backend& backend, const std::vector<Batch>& locals, int64_t loss_normalizer);
  // This stage's order of m micro-batches' ops under the layout's schedule.
  std::vector<PipelineOp> schedule(int m) const;
  // After a micro-batch's last op on this rank: the strategy's sums that close it, then its
  // saved state and kept block inputs go.
  static void finish_micro_batch(StageSteps& steps, std::unique_ptr<ModelStep>& step, std::vector<Tensor>& inputs);
  // The last stage's loss sums over its micro-batches' results to every stage (a broadcast
  // of two f64 over pp; a MoE model's 4 + E: the aux loss, the expert load and the dropped
  // pairs too).
  StepResult share_loss(const std::vector<StepResult>& results);
  // A MoE model's side values on the boundary (StageBoundary::set_side; 0 for a dense
  // model): the packed routing statistics with each activation, sparse layers x (2E + 2)
  // f64, and the aux loss's gradient with each gradient, sparse layers x E f64 (only when
  // the aux term is in the loss, output_router_logits).
  int64_t stats_values() const;
  int64_t aux_grad_values() const;
  // Host values as a comm tensor of the backend (undefined for none), and back.
  static Tensor side(Backend& backend, const std::vector<double>& values);
  static std::vector<double> to_host(Backend& backend, const Tensor& t);
  // Tied embeddings: the end stages add each other's embedding gradient.
  void sum_tied_embedding(Backend& backend);
  Status assemble(const ShardedWeights& shard, LlamaWeights& global);
  // This step's boundary, naming this rank by its place on the stage's weight axis.
  void configure(StageBoundary& boundary);

  LlamaConfig config_;
  Communicator& pp_;
  std::unique_ptr<StageStrategy> stage_;
  Layout layout_;
  std::string name_;
  int stage_index_ = 0, stages_ = 1;
  StageLayers layers_;
  ShardedWeights weights_;
  ShardedGrads grads_;
  BoundaryHooks hooks_;
  int64_t deferred_bytes_ = 0;
};

}  // namespace foldpar
