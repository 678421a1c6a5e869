// Internal to parallel/tpsp: the state of one TP x SP forward (+ backward) on one rank,
// shared by tpsp_block.cc (attention with the sp exchange, and the MLP) and tpsp_step.cc
// (rows mappings, embedding, head, loss, the gradient sums). Row counts: N = B*S/S_ the sp
// shard's tokens (what the column- and row-parallel GEMMs and attention see), R the rows of
// the residual stream on this rank (N, or N/T with sequence parallelism).
#pragma once

#include <chrono>
#include <vector>

#include "backend/backend.h"
#include "parallel/ring_attention.h"
#include "parallel/tensor_parallel.h"
#include "parallel/tpsp/tpsp_model.h"

namespace foldpar::tpsp_detail {

struct AttnSaved {
  Tensor x_in, rstd, a1;   // [R, h], [R], [R, h]
  Tensor a1_full;          // [N, h] sequence parallel, kept only by a recompute rerun
  Tensor q, k, v;          // [B, S/S_, heads, d], [B, S/S_, kv_heads, d]: local heads, after RoPE
  Tensor attn, lse;        // [B, S/S_, heads, d], [B, heads, S/S_]
  Tensor k_full, v_full;   // [B, S, kv_heads, d] all-gather exchange, kept only by a rerun
};

struct MlpSaved {
  Tensor x_mid, rstd, a2;  // [R, h], [R], [R, h]
  Tensor a2_full;          // [N, h], as a1_full
  Tensor gate, up, act;    // [N, f/T]
};

struct LayerSaved {
  AttnSaved attn;
  MlpSaved mlp;
};

struct HeadSaved {
  Tensor x_last, rstd;     // [R, h], [R]
  Tensor xf_full;          // [N, h]
  VocabParallelLoss loss;  // local logits [N, V/T], lse [N]
};

class TpspStep {
 public:
  // local: this rank's batch, i32 [B, local_seq].
  TpspStep(const TpspModel& model, Backend& backend, const TpspAxes& axes, const Batch& local);

  Tensor embed(const ShardedWeights& w);                          // x [R, h]
  void embed_backward(const Tensor& dx, ShardedWeights& grads);   // dx [R, h]

  // x [R, h] -> x_mid [R, h]. Fills `saved` when given; keep_gathered (a recompute rerun,
  // which backward follows at once) also keeps the gathered norm output and K/V.
  Tensor attention_forward(int layer, const ShardedWeights& w, const Tensor& x, AttnSaved* saved,
                           bool keep_gathered);
  // d(x_mid) [R, h] -> d(x) [R, h]; this rank's partial gradients += into grads.
  Tensor attention_backward(int layer, const ShardedWeights& w, AttnSaved& s, const Tensor& d_out,
                            ShardedWeights& grads);
  Tensor mlp_forward(int layer, const ShardedWeights& w, const Tensor& x_mid, MlpSaved* saved, bool keep_gathered);
  Tensor mlp_backward(int layer, const ShardedWeights& w, const MlpSaved& s, const Tensor& d_out,
                      ShardedWeights& grads);

  // Final norm, LM head, loss over the vocabulary shards (tp) and its sums over sp. With
  // `logits` also this rank's rows [R, V].
  StepResult head_forward(const ShardedWeights& w, const Tensor& x, HeadSaved& saved, Tensor* logits);
  // d(x_last) [R, h] of loss_sum / normalizer; the head's partials += grads.
  Tensor head_backward(const ShardedWeights& w, HeadSaved& s, int64_t normalizer, ShardedWeights& grads);

  // This step's partial gradients summed: the norm gains over tp (sequence parallel only),
  // then everything over sp, in place.
  void sum_partials(TpspGrads& partial);

  double blocked_seconds() const { return tp_.blocked_seconds() + sp_wait_seconds_; }

 private:
  Tensor act(const Shape& shape) const { return Tensor::empty(shape, DType::kF32, MemCategory::kActivations); }
  Tensor comm_buffer(const Shape& shape) const { return Tensor::empty(shape, DType::kF32, MemCategory::kComm); }
  // [R, h] -> [N, h]: f' (all_gather over tp) with sequence parallelism; identity otherwise.
  Tensor gather_rows(const Tensor& local);
  TpComm::Pending start_gather_rows(const Tensor& local, Tensor& full);
  // A partial [N, h] -> its tp sum on this rank's rows [R, h]: g (all_reduce in place) or g'.
  Tensor reduce_rows(Tensor& partial);
  TpComm::Pending start_reduce_rows(Tensor& partial, Tensor& out);

  // The sp exchange: K, V [B, S/S_, kv_heads, d] -> [B, S, kv_heads, d] in sp rank order.
  std::vector<CommRequest> start_gather_kv_pair(const Tensor& k, const Tensor& v, Tensor& k_full, Tensor& v_full);
  RingAttentionArgs ring_args(const AttnSaved& s);
  double attention_scale() const;
  void sp_wait(std::vector<CommRequest>& requests);
  static void sp_poke(std::vector<CommRequest>& requests);
  void sp_blocking(const Status& status, std::chrono::steady_clock::time_point started);

  const TpspModel& model_;
  const LlamaConfig& c_;
  const ShardDims& dims_;
  const TpspOptions& opt_;
  Backend& be_;
  TpComm tp_;
  Communicator& sp_;
  bool seq_par_;         // Megatron sequence parallelism inside the tp group
  bool gather_;          // the all-gather K/V exchange (else the ring)
  int64_t batch_;        // B
  int64_t sp_seq_;       // S/S_
  int64_t rows_;         // R
  int64_t all_rows_;     // N
  Tensor ids_, targets_; // i32 [N]: the sp shard's ids and targets
  Tensor q_pos_;         // i32 [S/S_] global positions of the sp shard's rows
  Tensor k_pos_;         // i32 [S] every sp rank's positions in rank order
  Tensor rope_;          // [S/S_, 2, d/2]
  double sp_wait_seconds_ = 0;
};

}  // namespace foldpar::tpsp_detail
