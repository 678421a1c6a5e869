// WeightShardedModel: the weights, gradients and assembly every weight-sharded strategy shares.
#include "parallel/sharded_model.h"

#include "comm/communicator.h"
#include "core/check.h"

namespace foldpar {

WeightShardedModel::WeightShardedModel(const LlamaConfig& config, const ShardDims& dims, Communicator& weight_axis,
                                       std::string layout, DType dtype, Counting counting)
    : weights_(ShardedWeights::allocate(config, dims, weight_axis.rank(), dtype, MemCategory::kParameters)),
      grads_(ShardedGrads::allocate(config, dims, weight_axis.rank(), MemCategory::kGradients)),
      weight_axis_(weight_axis),
      layout_(std::move(layout)),
      counting_(counting) {}

Result<StepResult> ShardedModel::forward_backward_micro_batches(Backend& be, const std::vector<Batch>& locals,
                                                               int64_t loss_normalizer) {
  StepResult sum;
  double aux_weighted = 0;  // MoE: each micro-batch's aux loss times its valid tokens
  for (const Batch& local : locals) {
    FP_ASSIGN_OR_RETURN(StepResult r, forward_backward(be, local, loss_normalizer));
    sum.loss_sum += r.loss_sum;
    sum.valid_tokens += r.valid_tokens;
    sum.exposed_comm_seconds += r.exposed_comm_seconds;
    aux_weighted += r.aux_loss * static_cast<double>(r.valid_tokens);
    if (sum.expert_load.empty()) sum.expert_load.assign(r.expert_load.size(), 0);
    for (size_t e = 0; e < r.expert_load.size(); ++e) sum.expert_load[e] += r.expert_load[e];
    sum.moe_dropped += r.moe_dropped;
  }
  const double valid = static_cast<double>(sum.valid_tokens);
  sum.loss = sum.valid_tokens > 0 ? sum.loss_sum / valid : 0.0;
  sum.aux_loss = sum.valid_tokens > 0 ? aux_weighted / valid : 0.0;
  return sum;
}

void sum_grads_over_data_axis(Communicator* dp, std::vector<ParamRef>& params, Communicator* expert_dp) {
  if (dp == nullptr || dp->size() == 1) return;
  for (ParamRef& p : params) {
    Communicator* axis = p.routed_expert && expert_dp != nullptr ? expert_dp : dp;
    if (axis->size() == 1) continue;
    FP_CHECK_OK(axis->all_reduce(p.grad.raw_data(), p.grad.raw_data(), static_cast<size_t>(p.grad.numel()),
                                 DType::kF32, ReduceOp::kSum));
  }
}

std::vector<ParamRef> WeightShardedModel::parameters() {
  return sharded_param_refs(weights_, grads_.views(), counting_.replicated, counting_.sharded);
}

Status WeightShardedModel::assemble(const ShardedWeights& shard, LlamaWeights& global) {
  if (weight_axis_.size() > 1) {
    FP_RETURN_IF_ERROR(assemble_global(shard, weight_axis_, global));
  } else {
    global.zero();
    unshard_into_global(shard, /*replicated=*/true, global);  // one rank holds everything (of the weight axis)
  }
  // Each weight-axis group holds its own experts (zero elsewhere): their sum over the groups.
  return sum_experts_across(expert_across_, global);
}

}  // namespace foldpar
