// Internal to parallel/tp: the state of one tensor-parallel forward (+ backward) on one rank,
// shared by tp_block.cc (attention and MLP) and tp_head.cc (embedding, head and loss).
// Row counts: N = B*S every token (what the column- and row-parallel GEMMs see), R the rows
// of the residual stream on this rank (N, or N/T with sequence parallelism).
#pragma once

#include <vector>

#include "backend/backend.h"
#include "parallel/tensor_parallel.h"
#include "parallel/tp/tp_model.h"

namespace foldpar::tp_detail {

// What the attention sub-block keeps for backward.
struct AttnSaved {
  Tensor x_in, rstd, a1;   // [R, h], [R], [R, h]: the norm region (1/T with sequence parallel)
  Tensor a1_full;          // [N, h] the gathered a1, kept only by a recompute rerun (else undefined)
  Tensor q, k, v;          // [B, S, heads, d], [B, S, kv_heads, d]: local heads, after RoPE
  Tensor attn, lse;        // [B, S, heads, d], [B, heads, S]
};

// What the MLP sub-block keeps for backward.
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
  Tensor xf_full;          // [N, h] the final norm's output on every token
  VocabParallelLoss loss;  // local logits [N, V/T], lse [N]
};

class TpStep {
 public:
  // ids, targets: i32 [B, S_local], this rank's batch.
  TpStep(const TpModel& model, Backend& backend, Communicator& tp, const Batch& local);

  // x [R, h] from the vocabulary shards.
  Tensor embed(const ShardedWeights& w);
  void embed_backward(const Tensor& dx, ShardedWeights& grads);

  // Returns x_mid = x + attention(norm(x)) [R, h]. Fills `saved` when given; keep_gathered
  // also keeps the gathered norm output (recompute reruns, which backward follows at once).
  Tensor attention_forward(int layer, const ShardedWeights& w, const Tensor& x, AttnSaved* saved,
                           bool keep_gathered);
  // From d(x_mid) [R, h]: returns d(x); adds the layer's gradients into grads.
  Tensor attention_backward(int layer, const ShardedWeights& w, const AttnSaved& s, const Tensor& d_out,
                            ShardedWeights& grads);
  Tensor mlp_forward(int layer, const ShardedWeights& w, const Tensor& x_mid, MlpSaved* saved, bool keep_gathered);
  Tensor mlp_backward(int layer, const ShardedWeights& w, const MlpSaved& s, const Tensor& d_out,
                      ShardedWeights& grads);

  // Final norm, LM head and loss over the vocabulary shards. With keep_logits also returns
  // this rank's logits rows [R, V] in `logits`.
  StepResult head_forward(const ShardedWeights& w, const Tensor& x, HeadSaved& saved, Tensor* logits);
  // d(x_last) [R, h] from the loss (scale 1 / global valid tokens).
  Tensor head_backward(const ShardedWeights& w, HeadSaved& s, int64_t valid_tokens, ShardedWeights& grads);

  // Sequence parallelism: the norm gains' gradients of this rank's rows are partial; one
  // packed all_reduce sums them over tp into grads. Plain TP: nothing (every rank already
  // holds the full-token gradient).
  void sum_norm_partials(ShardedWeights& grads);

  double blocked_seconds() const { return tp_.blocked_seconds(); }

  // Generation: attention_forward also stores K (after RoPE) and V of this rank's KV heads,
  // every token, into `cache` (KvCache::store_prefill).
  void set_kv_cache(KvCache* cache) { kv_cache_ = cache; }

 private:
  Tensor act(const Shape& shape) const { return Tensor::empty(shape, DType::kF32, MemCategory::kActivations); }
  Tensor comm_buffer(const Shape& shape) const { return Tensor::empty(shape, DType::kF32, MemCategory::kComm); }
  // [R, h] -> [N, h]: f' (all_gather) with sequence parallelism; identity otherwise.
  Tensor gather_rows(const Tensor& local);
  TpComm::Pending start_gather_rows(const Tensor& local, Tensor& full);
  // A partial [N, h] -> its tp sum on this rank's rows [R, h]: g (all_reduce, in place) or
  // g' (reduce_scatter). Returns the result (the partial itself without sequence parallel).
  Tensor reduce_rows(Tensor& partial);
  TpComm::Pending start_reduce_rows(Tensor& partial, Tensor& out);
  // The norm gain's gradient: grads directly (plain TP: every rank computes the same
  // full-token gradient) or this rank's partial (sequence parallel).
  Tensor& norm_grad(Tensor& grad, int index);

  const TpModel& model_;
  const LlamaConfig& c_;
  const ShardDims& dims_;
  const TpOptions& opt_;
  Backend& be_;
  TpComm tp_;
  bool sp_;
  int64_t batch_;       // B
  int64_t seq_;         // S
  int64_t rows_;        // R
  int64_t all_rows_;    // N
  Tensor ids_, targets_;  // i32 [N] every token's ids and targets
  Tensor positions_;    // i32 [S] 0..S-1
  Tensor rope_;         // [S, 2, d/2]
  std::vector<Tensor> norm_partials_;  // sequence parallel: attn_norm[L], mlp_norm[L], final_norm
  KvCache* kv_cache_ = nullptr;        // prefill only
};

}  // namespace foldpar::tp_detail
