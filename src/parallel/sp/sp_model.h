// SpModel: the Llama model under sequence (context) parallelism on one axis of sp ranks
// (docs/tsp.md sections 7-8, the SP baseline). Every rank holds the full weights
// (replicated) and S/sp of the tokens (SequenceShard, zigzag by default). Everything
// token-wise (embedding, norms, projections, MLP, LM head, loss) is local; attention sees
// every rank's keys through one of two exchanges:
//   kAllGather  fwd: all_gather K, V over sp;  bwd: all_gather again (the gathered K/V of a
//               layer is a transient, never kept across layers) + reduce_scatter dK, dV
//   kRing       fwd: K/V ring (parallel/ring_attention.h);  bwd: K/V ring again + dK/dV ring
// Weight gradients: each rank's partial (its tokens) is summed over the axis by one packed
// all_reduce at the end of the step (SpGrads). The loss is the mean over the valid tokens of
// the whole global batch (loss sum and count all_reduced).
//
// Traffic per layer per rank, elements (x4 bytes), KV = 2*B*S*h/g*(sp-1)/sp:
//   forward: KV (all_gather, or N-1 send_recv hops);  backward: KV again + KV of dK/dV
//   (all_gather + reduce_scatter, or send_recv hops both); recompute adds one forward's
//   KV for the ring (the all-gather exchange keeps the recomputed gather for the backward).
// Per step: all_reduce of every parameter (n = parameter_count()) and of 2 f64 (the loss).
//
// Collective over the sp communicator: every rank calls forward/forward_backward with the
// same batch size and options, in the same order.
#pragma once

#include <cstdint>

#include "comm/communicator.h"
#include "model/llama_model.h"
#include "parallel/sequence_shard.h"
#include "parallel/sharded_model.h"

namespace foldpar {

struct SpOptions {
  SeqSplit split = SeqSplit::kZigzag;  // zigzag balances the causal work over ranks
  LayoutOptions::KvExchange kv_exchange = LayoutOptions::KvExchange::kAllGather;
  // Start transfers before the computation that does not need them yet. false: every
  // transfer completes before the computation that follows it.
  bool overlap = true;
  // kBlock keeps only each block's input and reruns the block (with its exchange) in backward.
  Recompute recompute = Recompute::kNone;
  bool keep_logits = false;  // verification: return this rank's logits [B, S/sp, V]
};

// The gradients of the replicated weights in one flat buffer [parameter_count()], with
// LlamaWeights views into it in state-dict order, so that the sum over the axis is one
// all_reduce (a few when the model exceeds one MPI message).
class SpGrads {
 public:
  // category: kGradients for the gradients; a step's scratch partial uses the same.
  static SpGrads allocate(const LlamaConfig& config, MemCategory category);

  LlamaWeights& views() { return views_; }
  Tensor& flat() { return flat_; }
  void zero();
  // True from zero() until a step accumulates into it: such a step may sum its partial in
  // place instead of through a scratch buffer.
  bool known_zero() const { return known_zero_; }
  void mark_written() { known_zero_ = false; }

 private:
  Tensor flat_;         // [n] f32
  LlamaWeights views_;  // views into flat_
  bool known_zero_ = false;
};

class SpModel {
 public:
  // invalid_argument naming the numbers when S does not divide as the split needs.
  // Not collective.
  static Result<SpModel> create(const LlamaConfig& config, int degree, int rank, int64_t seq,
                                const SpOptions& options);

  const LlamaConfig& config() const { return config_; }
  const SequenceShard& shard() const { return shard_; }
  const SpOptions& options() const { return options_; }

  // Loss of this rank's rows local [B, S/sp] (SequenceShard::local_batch of the global batch).
  Result<StepResult> forward(Backend& backend, Communicator& sp, const LlamaWeights& weights,
                             const Batch& local) const;
  // Forward and backward; the gradient of the mean loss, summed over the axis, is
  // accumulated (+=) into grads on every rank.
  Result<StepResult> forward_backward(Backend& backend, Communicator& sp, const LlamaWeights& weights,
                                      const Batch& local, SpGrads& grads,
                                      int64_t loss_normalizer = 0) const;

 private:
  SpModel(const LlamaConfig& config, SequenceShard shard, const SpOptions& options)
      : config_(config), shard_(std::move(shard)), options_(options) {}

  LlamaConfig config_;
  SequenceShard shard_;
  SpOptions options_;
};

}  // namespace foldpar
