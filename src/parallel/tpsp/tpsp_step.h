// Internal to parallel/tpsp: the state of one TP x SP forward (+ backward) on one rank. What
// TP x SP shares with plain TP (row mappings over tp, embedding, head, MLP, the attention's
// projections, the order of a step) is parallel/tp_step_base.h on the sp shard's rows
// (tp_seq = S/sp); this adds the attention core with its K/V exchange over sp, the loss's
// sums over sp, and the sums of a step's partial gradients.
#pragma once

#include <chrono>
#include <vector>

#include "parallel/ring_attention.h"
#include "parallel/tp_step_base.h"
#include "parallel/tpsp/tpsp_model.h"

namespace foldpar::tpsp_detail {

using tp_detail::AttnSaved;
using tp_detail::HeadSaved;
using tp_detail::LayerSaved;
using tp_detail::MlpSaved;

class TpspStep : public tp_detail::TpStepBase {
 public:
  // local: this rank's batch, i32 [B, local_seq].
  TpspStep(const TpspModel& model, Backend& backend, const TpspAxes& axes, const Batch& local);

  Tensor attention_forward(int layer, const ShardedWeights& w, const Tensor& x, AttnSaved* saved,
                           bool keep_gathered) override;
  Tensor attention_backward(int layer, const ShardedWeights& w, AttnSaved& s, const Tensor& d_out,
                            ShardedWeights& grads) override;
  // The loss of the sp shard's rows, then its sum and valid count over sp: the global batch's.
  StepResult head_forward(const ShardedWeights& w, const Tensor& x, HeadSaved& saved, Tensor* logits) override;

  // This step's partial gradients summed: the norm gains over tp (sequence parallel only),
  // then everything over sp, in place.
  void sum_partials(TpspGrads& partial);

  double blocked_seconds() const override { return tp_.blocked_seconds() + sp_wait_seconds_; }

 private:
  // The sp exchange: K, V [B, S/sp, kv_heads, d] -> [B, S, kv_heads, d] in sp rank order.
  std::vector<CommRequest> start_gather_kv_pair(const Tensor& k, const Tensor& v, Tensor& k_full, Tensor& v_full);
  RingAttentionArgs ring_args(const AttnSaved& s);
  double attention_scale() const;
  void sp_wait(std::vector<CommRequest>& requests);
  static void sp_poke(std::vector<CommRequest>& requests);
  void sp_blocking(const Status& status, std::chrono::steady_clock::time_point started);

  const TpspModel& model_;
  const TpspOptions& opt_;
  Communicator& sp_;
  bool gather_;          // the all-gather K/V exchange (else the ring)
  Tensor q_pos_;         // i32 [S/sp] global positions of the sp shard's rows
  Tensor k_pos_;         // i32 [S] every sp rank's positions in rank order
  Tensor rope_;          // [S/sp, 2, d/2]
  double sp_wait_seconds_ = 0;
};

}  // namespace foldpar::tpsp_detail
