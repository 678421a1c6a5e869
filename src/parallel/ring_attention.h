// Ring attention over a sequence-sharded axis (SP, TP x SP): each rank's K/V block travels
// the ring (send to p+1, receive from p-1, N-1 hops) while the local queries attend to the
// block that is visiting; the per-block results are merged with the online softmax. No
// rank ever holds more than two K/V blocks. Shares nothing with the all-gather exchange
// (parallel/kv_exchange.h) but the position convention: k_pos is every rank's key
// positions rank by rank (SequenceShard::gathered_positions), block r at [r*Sk, (r+1)*Sk).
//   fwd: K/V ring (N-1 hops of 2*B*Sk*n_kv*d elements, one packed message per hop);
//   bwd: the K/V ring again, plus its adjoint, a ring that carries each block's dK/dV
//   accumulator home behind the blocks (N-1 more hops of the same size).
#pragma once

#include <span>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "parallel/step_timer.h"

namespace foldpar {

// The online-softmax merge of one block's attention result into the running result of the
// same queries (Backend::attention_merge): lse' = log(e^lse + e^block_lse), out' = e^(lse -
// lse') out + e^(block_lse - lse') block_out. A side at lse = -inf (no visible key)
// contributes nothing; rows where both are -inf stay at out 0, lse -inf.
// out, block_out: [B, Sq, n_h, d] f32 or both bf16; lse, block_lse: [B, n_h, Sq] f32 (Backend's layout).
// out and lse are updated in place. Not collective.
void merge_attention_block(Backend& be, const Tensor& block_out, const Tensor& block_lse, Tensor& out, Tensor& lse);

struct RingAttentionArgs {
  Communicator* axis = nullptr;  // the sequence axis, N ranks; this rank p
  Backend* backend = nullptr;
  const Tensor* q = nullptr;      // [B, Sq, n_h, d] this rank's queries (RoPE applied)
  const Tensor* k = nullptr;      // [B, Sk, n_kv, d] this rank's keys (RoPE applied)
  const Tensor* v = nullptr;      // [B, Sk, n_kv, d] this rank's values
  const Tensor* q_pos = nullptr;  // i32 [Sq], global positions of the queries
  const Tensor* k_pos = nullptr;  // i32 [N * Sk], every rank's key positions in rank order
  // The same positions on the host, for the schedule (which blocks any query can see).
  std::span<const int32_t> q_positions, k_positions;
  double scale = 0;               // softmax scale, usually 1/sqrt(d)
  int64_t window = 0;             // sliding window (AttentionArgs::window); 0: full causal
  // Start each hop before the attention of the block at hand (it overlaps the compute);
  // false: every hop completes before the computation that follows it.
  bool overlap = true;
  StepTimer* timer = nullptr;  // when set, the time blocked on the ring is counted here
};

// Causal attention of the local queries against the keys of every rank. q, k, v: f32, or
// all bf16 (bf16 storage: the blocks travel in bf16).
// out (written) [B, Sq, n_h, d] in q's dtype, lse (written) [B, n_h, Sq] f32: equal to Backend::attention_forward
// against the gathered K/V up to summation order. Collective over args.axis (point-to-point
// only: every rank calls it in the same order with the same shapes).
void ring_attention_forward(const RingAttentionArgs& args, Tensor& out, Tensor& lse);

// The adjoint. out, lse: the FINAL result of ring_attention_forward (with them the gradient
// of each block is exact: P = e^(S - lse), delta = rowsum(dO * out)); d_out [B, Sq, n_h, d].
// dq (written) [B, Sq, n_h, d]; dk, dv (written) [B, Sk, n_kv, d]: the gradient of this
// rank's keys and values summed over every rank's queries. Collective over args.axis.
void ring_attention_backward(const RingAttentionArgs& args, const Tensor& out, const Tensor& lse,
                             const Tensor& d_out, Tensor& dq, Tensor& dk, Tensor& dv);

}  // namespace foldpar
