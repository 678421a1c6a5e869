// Internal to parallel/sp: the state of one SP forward (+ backward) on one rank, shared by
// the attention exchanges (sp_attention.cc) and the token-wise parts (sp_step.cc).
// T = B*S/sp local rows; every tensor below holds local tokens only, except the gathered
// K/V of the all-gather exchange.
#pragma once

#include <chrono>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "parallel/ring_attention.h"
#include "parallel/sp/sp_model.h"

namespace foldpar::sp_detail {

// What one block keeps for its backward (all of it, or only x_in under Recompute::kBlock).
struct LayerSaved {
  Tensor x_in, rstd_attn, a1;     // [T, h], [T], [T, h]
  Tensor q, k, v;                 // [B, S/sp, n_h | n_kv, d], q and k after RoPE
  Tensor attn, lse;               // [B, S/sp, n_h, d], [B, n_h, S/sp]
  // All-gather exchange, Recompute::kBlock only: the gathered K/V [B, S, n_kv, d] of the
  // rerun, used at once by the backward that follows it instead of a second gather.
  Tensor k_full, v_full;
  Tensor x_mid, rstd_mlp, a2;     // [T, h], [T], [T, h]
  Tensor gate, up, act;           // [T, f]
};

struct HeadSaved {
  Tensor x_last, rstd, xf;  // [T, h], [T], [T, h]
  Tensor logits;            // [T, V]; overwritten by d_logits in backward
  Tensor lse;               // [T]
};

class SpStep {
 public:
  SpStep(const SpModel& model, Backend& backend, Communicator& comm, int64_t batch);

  // x_in [T, h] -> x_out [T, h]. Fills `saved` when given; keep_gathered (all-gather
  // exchange) also keeps the gathered K/V in it, for a backward that follows at once.
  Tensor block_forward(const LayerWeights& w, const Tensor& x_in, LayerSaved* saved, bool keep_gathered);
  // dx_out [T, h] -> dx_in [T, h]; this rank's partial weight gradients += into g. Releases
  // the gathered K/V kept in `s` once used.
  Tensor block_backward(const LayerWeights& w, LayerSaved& s, const Tensor& dx_out, LayerWeights& g);

  Tensor embed(const LlamaWeights& w, const Tensor& ids);  // ids i32 [T] -> x [T, h]
  void embed_backward(const Tensor& ids, const Tensor& dx, LlamaWeights& g);
  // Final norm, LM head, the local loss sum and the sums over the axis (one all_reduce of
  // two f64). With keep_logits, result.logits = a copy of the local logits [T, V].
  StepResult head_forward(const LlamaWeights& w, const Tensor& x, const Tensor& targets, HeadSaved& hs,
                          bool keep_logits);
  // d(x_last) [T, h] of the mean loss over valid_tokens (global); the head's partials += g.
  Tensor head_backward(const LlamaWeights& w, HeadSaved& hs, const Tensor& targets, int64_t valid_tokens,
                       LlamaWeights& g);

  // Sums a flat gradient buffer over the axis in place (all_reduce, in chunks that MPI's
  // int counts can address).
  void all_reduce_grads(Tensor& flat);

  // Seconds blocked on communication (waits and blocking collectives).
  double wait_seconds() const { return wait_seconds_; }

 private:
  Tensor attention_forward(const LayerWeights& w, const Tensor& x, LayerSaved& s, bool keep_gathered);
  Tensor attention_backward(const LayerWeights& w, LayerSaved& s, const Tensor& d_out, LayerWeights& g);
  // The ring exchange's arguments for this layer's local q, k, v.
  RingAttentionArgs ring_args(const LayerSaved& s);
  // K, V [B, S/sp, n_kv, d] -> [B, S, n_kv, d] in rank order (2B all-gathers), not waited.
  std::vector<CommRequest> start_gather(const Tensor& k, const Tensor& v, Tensor& k_full, Tensor& v_full);

  Tensor act(const Shape& shape) const { return Tensor::empty(shape, DType::kF32, MemCategory::kActivations); }
  Tensor comm_buffer(const Shape& shape) const { return Tensor::empty(shape, DType::kF32, MemCategory::kComm); }
  void wait_all(std::vector<CommRequest>& requests);
  void poke(std::vector<CommRequest>& requests);
  void blocking(const Status& status, std::chrono::steady_clock::time_point started);

  const LlamaConfig& c_;
  const SpOptions& opt_;
  Backend& be_;
  Communicator& comm_;
  int64_t batch_;      // B
  int64_t local_seq_;  // S/sp
  int64_t rows_;       // T
  int64_t seq_;        // S
  Tensor q_pos_;       // i32 [S/sp]
  Tensor k_pos_;       // i32 [S], rank order (the gathered K/V's, and the ring's blocks)
  Tensor rope_;        // [S/sp, 2, d/2] at the local positions
  double wait_seconds_ = 0;
};

}  // namespace foldpar::sp_detail
