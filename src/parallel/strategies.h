// The factory of each strategy, one per folder (tsp/, megatron/); make_layout.cc picks one
// from the mesh.
// Each returns invalid_argument naming the numbers when the sizes do not divide.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "parallel/sharded_decoder.h"
#include "parallel/sharded_model.h"
#include "parallel/stage_decoder.h"
#include "parallel/stage_strategy.h"

namespace foldpar {

// tsp/: Tensor-and-Sequence Parallelism over one axis. dp (null: none): the data-parallel
// axis, which a MoE model's routing statistics are also summed over (tsp_model.h); the
// gradients' dp sum stays the trainer's (sum_grads_over_data_axis).
// wide: the expert groups over dp replicas (Layout::ep; make_layout.cc), empty otherwise.
Result<std::unique_ptr<ShardedModel>> make_tsp_sharded_model(const LlamaConfig& config, Communicator& tsp,
                                                             Communicator* dp, int64_t seq, const Layout& options,
                                                             ExpertDataAxes wide = {});
// megatron/: Megatron tensor parallelism inside tp groups, sequence (context) parallelism
// across them: tp=T (sp null), sp=S (tp null) and tp=T,sp=S. A null axis runs as one rank.
// A MoE model's experts spread over the tp x sp group (expert parallelism): `ep` is that
// group's communicator (rank sp * tp + t), or null where tp or sp has one rank (the other is
// the group); dp the replicas its routing statistics are summed over (or null). wide: the
// expert groups over dp replicas (Layout::ep), which replace `ep` (then null); empty otherwise.
Result<std::unique_ptr<ShardedModel>> make_megatron_sharded_model(const LlamaConfig& config, Communicator* tp,
                                                                  Communicator* sp, int64_t seq,
                                                                  const Layout& options,
                                                                  std::unique_ptr<Communicator> ep = nullptr,
                                                                  Communicator* dp = nullptr,
                                                                  ExpertDataAxes wide = {});

// Pipeline stages (parallel/stage_strategy.h): tsp/'s and megatron/'s (a null axis runs as
// one rank) step pieces over one stage's layers;
// pipeline/'s model over the pp axis (layout.pp stages, this rank's stage pp.rank()), which
// owns the stage's weights and runs the 1F1B schedule over the stage strategy.
// dp (null: none): the replicas a MoE model's routing statistics are summed over on the last
// stage, as make_tsp_sharded_model's. wide: this stage's expert groups over dp replicas
// (Layout::ep; make_layout.cc cuts them per stage), empty otherwise.
Result<std::unique_ptr<StageStrategy>> make_tsp_stage_strategy(const LlamaConfig& config, Communicator& tsp,
                                                               Communicator* dp, int64_t seq, const Layout& layout,
                                                               ExpertDataAxes wide = {});
// A Megatron stage of a MoE model: ep, dp and wide as make_megatron_sharded_model's (wide:
// this stage's expert groups).
Result<std::unique_ptr<StageStrategy>> make_megatron_stage_strategy(const LlamaConfig& config, Communicator* tp,
                                                                    Communicator* sp, int64_t seq,
                                                                    const Layout& layout,
                                                                    std::unique_ptr<Communicator> ep = nullptr,
                                                                    Communicator* dp = nullptr,
                                                                    ExpertDataAxes wide = {});
Result<std::unique_ptr<ShardedModel>> make_pipeline_model(const LlamaConfig& config, Communicator& pp,
                                                          std::unique_ptr<StageStrategy> stage, const Layout& layout);

// Generation (parallel/sharded_decoder.h): TSP's decoder (KV cache sharded by sequence) and
// TP's (megatron/, tp=T: sharded by heads). Each reads split, overlap and head_buckets (tsp)
// of the options.
Result<std::unique_ptr<ShardedDecoder>> make_tsp_decoder(const LlamaConfig& config, Communicator& tsp,
                                                         const Layout& options);
Result<std::unique_ptr<ShardedDecoder>> make_tp_decoder(const LlamaConfig& config, Communicator& tp,
                                                        const Layout& options);

// Generation under pp (parallel/stage_decoder.h, pipeline/pipeline_decoder.h): TSP's pieces
// over one stage's layers, and pipeline/'s decoder over the pp axis (layout.pp stages, this
// rank's stage pp.rank()), which runs them with the boundary moves and groups in flight.
Result<std::unique_ptr<StageDecoder>> make_tsp_stage_decoder(const LlamaConfig& config, Communicator& tsp,
                                                             const Layout& layout, const StageLayers& layers);
// tp=T stages (sp = 1; sequence parallelism is decided by the caller, make_layout.cc):
// TpDecoder's pieces over one stage's layers (megatron/megatron_decoder.cc).
Result<std::unique_ptr<StageDecoder>> make_tp_stage_decoder(const LlamaConfig& config, Communicator& tp,
                                                            const Layout& layout, const StageLayers& layers);
Result<std::unique_ptr<ShardedDecoder>> make_pipeline_decoder(const LlamaConfig& config, Communicator& pp,
                                                              std::unique_ptr<StageDecoder> stage, const Layout& layout);

}  // namespace foldpar
