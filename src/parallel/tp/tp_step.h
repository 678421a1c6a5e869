// Internal to parallel/tp: the state of one tensor-parallel forward (+ backward) on one rank.
// What TP shares with TP x SP (row mappings, embedding, head, MLP, the attention's
// projections, the order of a step) is parallel/tp_step_base.h; this adds plain TP's
// attention core (every token's queries against every token's keys, local) and, with
// sequence parallelism, the norm gains' partial gradients. tp_seq = S: every token.
#pragma once

#include <vector>

#include "parallel/kv_cache.h"
#include "parallel/tp/tp_model.h"
#include "parallel/tp_step_base.h"

namespace foldpar::tp_detail {

class TpStep : public TpStepBase {
 public:
  // ids, targets: i32 [B, S_local], this rank's batch.
  TpStep(const TpModel& model, Backend& backend, Communicator& tp, const Batch& local);

  Tensor attention_forward(int layer, const ShardedWeights& w, const Tensor& x, AttnSaved* saved,
                           bool keep_gathered) override;
  Tensor attention_backward(int layer, const ShardedWeights& w, AttnSaved& s, const Tensor& d_out,
                            ShardedWeights& grads) override;

  // Sequence parallelism: the norm gains' gradients of this rank's rows are partial; one
  // packed all_reduce sums them over tp into grads. Plain TP: nothing (every rank already
  // holds the full-token gradient).
  void sum_norm_partials(ShardedWeights& grads);

  // Generation: attention_forward also stores K (after RoPE) and V of this rank's KV heads,
  // every token, into `cache` (KvCache::store_prefill).
  void set_kv_cache(KvCache* cache) { kv_cache_ = cache; }

 private:
  // The norm gain's gradient: grads directly (plain TP: every rank computes the same
  // full-token gradient) or this rank's partial (sequence parallel).
  Tensor& norm_grad(Tensor& grad, int index) override;

  Tensor positions_;                   // i32 [S] 0..S-1
  Tensor rope_;                        // [S, 2, d/2]
  std::vector<Tensor> norm_partials_;  // sequence parallel: attn_norm[L], mlp_norm[L], final_norm
  KvCache* kv_cache_ = nullptr;        // prefill only
};

}  // namespace foldpar::tp_detail
