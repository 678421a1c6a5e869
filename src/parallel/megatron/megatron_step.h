// Internal to parallel/megatron: the state of one forward (+ backward) on one rank, a
// ModelStep for the model's step order (model/step_order.h). The tensor-parallel half (row
// mappings over tp, embedding, head, the mappings around the model's MLP and attention
// projections) is tp_step_base.h on the sp shard's rows (tp_seq = S/sp); this adds the
// attention core (local with one sp rank, else with its K/V exchange over sp), the loss's
// sums over sp, and the sums of a step's partial gradients. Every wait, on either axis, is
// counted by the tp half's StepTimer.
#pragma once

#include <memory>
#include <vector>

#include "parallel/kv_cache.h"
#include "parallel/megatron/megatron_model.h"
#include "parallel/megatron/tp_step_base.h"
#include "parallel/ring_attention.h"

namespace foldpar::megatron_detail {

class MegatronStep : public TpStepBase {
 public:
  // local: this rank's batch, i32 [B, local_seq]; in.grads (a training step): the
  // gradients this step accumulates its partial into (sum_partials() sums it).
  MegatronStep(const MegatronModel& model, Backend& backend, const MegatronAxes& axes, const Batch& local,
               TpStepInputs in);

  // The loss of the sp shard's rows, then its sum and valid count over sp: the global batch's.
  // A MoE model: plus the aux loss of the routing statistics summed over the expert axis
  // (tp x sp) and dp.
  StepResult head_forward(const Tensor& x, bool save) override;
  // A MoE model: the aux loss's gradient for the sparse layers' backward first.
  Tensor head_backward(const StepResult& result) override;

  // This step's partial gradients summed. More than one sp rank: the norm gains over tp
  // (sequence parallel only), then everything over sp, in place. One sp rank: the gains'
  // partials (sequence parallel only) over tp, added into `partial` (the gradients).
  void sum_partials(ShardedGrads& partial);
  // Only the attention variants' partials, over tp, added into `grads`: a pipeline stage with
  // several sp ranks, after each micro-batch (its gradients are summed over sp once, after
  // the last). Collective over tp; nothing issued without variants.
  void sum_variant_partials(ShardedGrads& grads) { sum_variant_grads(grads.views()); }

  // Generation: attention_forward also stores K (after RoPE) and V of this rank's KV heads,
  // every token, into `cache` (KvCache::store_prefill). One sp rank only.
  // A MoE model's sparse layers then run generation's replicated form (tp_moe.cc).
  void set_kv_cache(KvCache* cache) {
    kv_cache_ = cache;
    moe_replicated_ = cache != nullptr;
  }

 private:
  // One sp rank, sequence parallel: the gains' gradients of this rank's rows are partial
  // over tp and go to norm_partials_ (the gradients themselves hold earlier micro-batches').
  Tensor& norm_grad(Tensor& grad, int index) override;
  Tensor attention_forward(int layer, const Tensor& x, AttnSaved* saved, bool keep_gathered) override;
  Tensor attention_backward(int layer, AttnSaved& s, const Tensor& d_out) override;
  // The sp exchange: K, V [B, S/sp, kv_heads, d] -> [B, S, kv_heads, d] in sp rank order.
  std::vector<CommRequest> start_gather_kv_pair(const Tensor& k, const Tensor& v, Tensor& k_full, Tensor& v_full);
  RingAttentionArgs ring_args(const AttnSaved& s);
  double attention_scale() const;

  const MegatronModel& model_;
  const Layout& opt_;
  Communicator& sp_;
  bool local_;   // one sp rank: attention of every position, no exchange
  bool gather_;  // the all-gather K/V exchange (else the ring), more than one sp rank
  std::vector<int32_t> q_positions_, k_positions_;  // q_pos_ and k_pos_ on the host (k: more than one sp rank)
  Tensor q_pos_;  // i32 [S/sp] global positions of the sp shard's rows
  Tensor k_pos_;  // i32 [S] every sp rank's positions in rank order (q_pos_ itself with one sp rank)
  Tensor rope_;   // [S/sp, 2, d/2]
  std::vector<Tensor> norm_partials_;  // one sp rank, sequence parallel: attn_norm[L], mlp_norm[L], final_norm
  KvCache* kv_cache_ = nullptr;        // prefill only
  Communicator* dp_;                   // MoE: the replicas the routing statistics are summed over (or null)
  Communicator* expert_dp_;            // MoE, ep over dp: the replicas holding the same experts (or null)
  std::unique_ptr<MoeAux> aux_;        // MoE: the step's routing statistics, summed
  int64_t step_valid_ = -1;            // the valid targets over sp (and dp for a MoE model); -1 before the head
};

// Gradients each sp rank accumulated over its own tokens, summed: the norm gains over tp
// first (sequence parallel: each rank saw its rows), then the whole flat buffer over sp, in
// place. Collective over tp and sp (MegatronStep::sum_partials with several sp ranks; a
// pipeline stage once per step).
void sum_grads_over_sp(TpComm& tp, Communicator& sp, bool seq_par, ShardedGrads& partial);

// A local batch's shapes and ids against the model (invalid_argument naming them).
Status check_local_batch(Backend& backend, const MegatronModel& model, const Batch& local);

}  // namespace foldpar::megatron_detail
