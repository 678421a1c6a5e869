// The factory of each strategy, one per folder; make_layout.cc picks one from the mesh.
// Each returns invalid_argument naming the numbers when the sizes do not divide.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "parallel/sharded_decoder.h"
#include "parallel/sharded_model.h"

namespace foldpar {

// tsp/: Tensor-and-Sequence Parallelism over one axis.
Result<std::unique_ptr<ShardedModel>> make_tsp_sharded_model(const LlamaConfig& config, Communicator& tsp,
                                                             int64_t seq, const LayoutOptions& options);
// tp/: Megatron tensor parallelism (optionally with sequence-parallel norm regions).
Result<std::unique_ptr<ShardedModel>> make_tp_sharded_model(const LlamaConfig& config, Communicator& tp,
                                                            int64_t seq, const LayoutOptions& options);
// sp/: sequence (context) parallelism with replicated weights.
Result<std::unique_ptr<ShardedModel>> make_sp_sharded_model(const LlamaConfig& config, Communicator& sp,
                                                            int64_t seq, const LayoutOptions& options);
// tpsp/: the 2-D mesh, tensor parallel inside, sequence parallel across.
Result<std::unique_ptr<ShardedModel>> make_tpsp_sharded_model(const LlamaConfig& config, Communicator& tp,
                                                              Communicator& sp, int64_t seq,
                                                              const LayoutOptions& options);

// Generation (parallel/sharded_decoder.h): TSP's decoder (KV cache sharded by sequence) and
// TP's (sharded by heads). Each reads split, overlap and head_buckets (tsp) of the options.
Result<std::unique_ptr<ShardedDecoder>> make_tsp_decoder(const LlamaConfig& config, Communicator& tsp,
                                                         const LayoutOptions& options);
Result<std::unique_ptr<ShardedDecoder>> make_tp_decoder(const LlamaConfig& config, Communicator& tp,
                                                        const LayoutOptions& options);

}  // namespace foldpar
