// Internal to parallel/tsp: the state of one TSP forward (+ backward) on one rank, shared
// by the schedules of tsp_attention.cc, tsp_mlp.cc and tsp_vocab.cc. T = B*S/D local rows.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "model/moe_layer.h"
#include "model/step_order.h"
#include "model/sub_blocks.h"
#include "parallel/moe_dispatch.h"
#include "parallel/step_timer.h"
#include "parallel/tsp/tsp_model.h"

namespace foldpar::tsp_detail {

// What attention keeps for backward, per layer. Units are (shard r, bucket b) in visiting
// order, index r * buckets + b.
struct AttnSaved {
  NormSaved norm;                 // x_in [T, h], rstd [T], a1 [T, h]
  std::vector<Tensor> q;          // per unit [B, S/D, heads_b, d], after RoPE
  std::vector<Tensor> k, v;       // per unit [B, S/D, kvh_b, d], local tokens (k after RoPE)
  std::vector<Tensor> attn, lse;  // per unit [B, S/D, heads_b, d], [B, heads_b, S/D]
  std::vector<Tensor> k_full, v_full;  // keep_kv: per unit [B, S, kvh_b, d]
  std::vector<Tensor> weights;    // keep_weights: per shard r, the broadcast copy (undefined for r == p)
  std::vector<QkvSaved> normed;   // q/k norms (qwen3): per unit the pre-norm q_raw, k_raw and their rstd
};

// What the MLP keeps for backward, per layer. Steps j = 0..D-1 visit shard (p - j) mod D.
struct RingMlpSaved {
  NormSaved norm;                        // x_mid [T, h], rstd [T], a2 [T, h]
  std::vector<foldpar::MlpSaved> chunks;  // per step: gate, up, act [T, f/D]
};

// MoeDispatch and MoeShardSaved: parallel/moe_dispatch.h (scheme A is shared with the Megatron
// baselines' expert parallelism).

struct LayerSaved {
  AttnSaved attn;
  RingMlpSaved mlp;
  MoeShardSaved moe;
};

// The vocabulary-sharded head: what the backward needs.
struct HeadSaved {
  Tensor x_last, rstd, xf;  // [T, h], [T], [T, h]
  Tensor lse;               // [T], over the full vocabulary
};

class TspStep {
 public:
  TspStep(const TspModel& model, Backend& backend, Communicator& comm, int64_t batch);

  // Attention sub-block: returns x_mid = x + attention(norm(x)). Fills `saved` when given.
  Tensor attention_forward(int layer, const ShardedWeights& w, const Tensor& x, AttnSaved* saved);
  // From d(x_mid): returns d(x); adds the layer's packed attention gradient (summed over the
  // axis) into grads.attn[layer] and this rank's norm-gain partial into norm_partials().
  Tensor attention_backward(int layer, const ShardedWeights& w, const AttnSaved& s, const Tensor& d_out,
                            ShardedWeights& grads);

  // MLP sub-block: returns x_out = x_mid + mlp(norm(x_mid)), the model's MLP over the D
  // column chunks of the ring. Fills `saved` when given.
  Tensor mlp_forward(int layer, const ShardedWeights& w, const Tensor& x_mid, RingMlpSaved* saved);
  Tensor mlp_backward(int layer, const ShardedWeights& w, const RingMlpSaved& s, const Tensor& d_out,
                      ShardedWeights& grads);

  // A MoE model's sparse layer instead of the MLP (tsp_moe.cc): x_out = x_mid + moe(norm(x_mid)).
  Tensor moe_forward(int layer, const ShardedWeights& w, const Tensor& x_mid, MoeShardSaved* saved);
  Tensor moe_backward(int layer, const ShardedWeights& w, const MoeShardSaved& s, const Tensor& d_out,
                      ShardedWeights& grads);
  // Where moe_forward records this rank's routing statistics (per sparse layer, by
  // sparse_index), and the aux loss's gradient on the router probabilities moe_backward
  // reads (MoeAux::prob_grad of the summed statistics; null or empty: none): the
  // micro-batch's own (TspModelStep sets both around its blocks), since a pipeline stage's
  // micro-batches in flight share the step. Borrowed; null: nothing recorded.
  void set_moe_stats(MoeAux* stats) { moe_stats_ = stats; }
  void set_moe_prob_grad(const std::vector<std::vector<double>>* g) { moe_prob_grad_ = g; }
  // `local` (this rank's routing statistics) summed over the axis (one all-reduce) and, with
  // a data-parallel axis of more than one rank, over the replicas too (one more all-reduce,
  // which also sums *valid_tokens, the axis's valid targets, into the global batch's): the
  // single-rank model's on the whole global batch. Collective over the axis and data_axis.
  MoeAux sum_moe_stats(const MoeAux& local, Communicator* data_axis, int64_t* valid_tokens);
  MoeDispatch moe_scheme() const;

  // Embedding by the vocabulary ring: x [T, h].
  Tensor embed(const ShardedWeights& w, const Tensor& ids);
  void embed_backward(const Tensor& ids, const Tensor& dx, ShardedWeights& grads);
  // Final norm, LM head by the ring with an online log-sum-exp, and the loss over the whole
  // axis. With keep_logits also returns the local logits [T, V] in `logits`.
  StepResult head_forward(const ShardedWeights& w, const Tensor& x, const Tensor& targets, HeadSaved& saved,
                          Tensor* logits);
  // d(x_last) from the loss (scaled by 1 / global valid tokens).
  Tensor head_backward(const ShardedWeights& w, const HeadSaved& s, const Tensor& targets, int64_t valid_tokens,
                       ShardedWeights& grads);

  // Partial norm-gain gradients of this rank's tokens; sum_norm_partials() all-reduces them
  // over the axis and adds them into grads. So for the attention variants' replicated
  // gradients (q/k/v and o biases, q/k norms: every head's over this rank's tokens), in a
  // second all-reduce of L (n_h d + 2 n_kv d + h + 2d) floats at most.
  void sum_norm_partials(ShardedWeights& grads);

  // Generation: attention_forward also stores each unit's K (after RoPE) and V of the local
  // tokens into `cache` (KvCache::store_prefill), shard r's bucket b at KV head
  // kv_head0(r) + b * kv_heads / buckets, so the cache holds every head of this rank's tokens.
  void set_kv_cache(KvCache* cache) { kv_cache_ = cache; }

  // The zero-bubble split (model/step_order.h, ModelStep::defer_weight_grads): the sub-blocks'
  // weight-gradient products go to `queue` (null: run at once), and so does what sends them
  // home (attention's reduce of each packed shard to its owner, the MLP's gradient ring, the
  // KV replicas' copy), in the same order, after the products it moves: W runs the reduces
  // and the ring that B would have run, so the axis's bytes and calls are unchanged. The
  // products write into two partial buffers per sub-block kept for the step (the deferred
  // partials below), used alternately as B uses its transient ones. Every rank of the axis
  // runs its W at the same slot of the schedule (a stage's ranks share it), so the
  // collectives stay in the same order on every rank. Dense layers only (moe_backward's
  // dispatch sums its expert gradients during the backward; TspModelStep refuses it).
  void set_weight_grads(WeightGradQueue* queue) { ctx_.weight_grads = queue; }

  // Seconds this rank has spent blocked on communication (waits and blocking collectives):
  // the exposed communication time, what overlap failed to hide.
  double wait_seconds() const { return timer_.seconds(); }

 private:
  // Buckets of one attention shard: the row views of its weights for bucket b.
  struct BucketWeights {
    Tensor wq, wk, wv, wo_t;
  };
  BucketWeights bucket_weights(const Tensor& packed, int bucket) const;
  static QkvWeights qkv_view(const BucketWeights& b) { return QkvWeights{b.wq, b.wk, b.wv}; }
  static LinearView wo_view(const BucketWeights& b) { return LinearView{b.wo_t, true}; }
  // A packed MLP shard [mlp_rows, h] as the model's column chunk of f/D columns.
  MlpWeights mlp_chunk(const Tensor& packed) const;
  // The same with layer l's MLP biases for ring step `step`: the gate/up slices of the
  // chunk's owner, the down bias at step 0 only (so once per token).
  MlpWeights mlp_chunk(const Tensor& packed, const ShardedWeights& w, int l, int step) const;
  // Activations in the storage dtype; per-row statistics (rstd, lse) always f32.
  Tensor act(const Shape& shape) const { return Tensor::empty(shape, opt_.dtype, MemCategory::kActivations); }
  Tensor stat(const Shape& shape) const { return Tensor::empty(shape, DType::kF32, MemCategory::kActivations); }
  // Buffers for what travels: weights and K/V in the storage dtype, gradients f32.
  Tensor comm_buffer(const Shape& shape, DType dtype) const { return Tensor::empty(shape, dtype, MemCategory::kComm); }
  // K/V of local tokens [B, S/D, kvh_b, d] -> [B, S, kvh_b, d] in rank order (B all-gathers).
  std::vector<CommRequest> start_gather(const Tensor& local, Tensor& full);
  std::vector<CommRequest> start_reduce_scatter(const Tensor& full, Tensor& local);
  // The step's waits, counted by timer_ (parallel/step_timer.h).
  void wait_all(std::vector<CommRequest>& requests) { timer_.wait_all(requests); }
  void wait(CommRequest& request) { timer_.wait(request); }
  void blocking(const Status& status, StepTimer::Clock::time_point started) { timer_.blocking(status, started); }
  // Advances in-flight transfers (MPI progresses only inside MPI calls).
  static void poke(std::vector<CommRequest>& requests) { StepTimer::poke(requests); }
  // Scheme C: a rank's El experts in one ring block [El * 3 f, h] (per expert gate, up, down;
  // f = dims.expert_rows, f_e or a split expert's slice): the layer's expert_block where the
  // experts are its views (no copy), else a packed copy; and expert j's views into a block.
  Tensor pack_experts(const MoeLayerWeights& w) const;
  ExpertWeights expert_block(const Tensor& block, int64_t j) const;
  // choices: [E] the top-k choices of this rank's tokens per expert, before any capacity drop;
  // dropped: how many of them the drop took.
  void record_moe_stats(const MoeLayerWeights& w, const std::vector<int64_t>& choices, int64_t dropped,
                        const Tensor& probs);
  // The capacity limit (MoeConfig::capacity_factor) on this rank's host expert ids [T, k]: it
  // counts each sequence's pairs in global position order, so the ranks all-gather their ids
  // over the axis (B S k i32) and each applies moe_drop_over_capacity to the whole sequences,
  // keeping its own rows' verdicts: the single-rank model's drops exactly. No-op when dropless.
  void drop_over_capacity(std::vector<int32_t>& ids);
  // One attention unit's bias gradients (views into unit_bias_grad_, zeroed; undefined
  // without the biases): its q heads' and KV heads' slices and the o bias.
  struct UnitBiasGrads {
    Tensor q, k, v, o;  // [heads_b d], [kvh_b d], [kvh_b d], [h]
  };
  UnitBiasGrads unit_bias_grads();
  // grad += the sum over the axis of partial (a replicated tensor's gradient; blocking).
  void sum_into(Tensor& partial, Tensor& grad);
  // At ring step j this rank holds the shard of rank (p - j) mod D.
  int ring_owner(int step) const;
  // The communicator the MoE all-to-all runs over: the expert group when the experts spread
  // over dp replicas too (TspModel::expert_group), else the tsp axis.
  Communicator& expert_comm() const { return model_.expert_group() != nullptr ? *model_.expert_group() : comm_; }

  // A layer's attention shards as they arrive by broadcast (fwd: broadcast from r; bwd:
  // reduce to r), two buffers used alternately for the shards not kept.
  struct ShardBroadcast {
    explicit ShardBroadcast(int degree) : shard(static_cast<size_t>(degree)) {}
    std::vector<Tensor> shard;  // per rank r: where its shard is while it is used
    Tensor buffers[2];
    CommRequest request;        // the broadcast in flight
  };
  // Points bc.shard[r] at shard r: the owner's `own` tensor, a copy kept for backward
  // (`kept`: reused, nothing moves), a fresh buffer kept into *keep_into, or one of the two
  // buffers; then starts its broadcast from r.
  void start_shard_broadcast(ShardBroadcast& bc, int r, const Tensor& own, Tensor* keep_into, const Tensor* kept);

  // A ring of weight shards: step j computes with `cur` while the hop brings the next one
  // (fwd: forward ring; its adjoint is the gradient ring below). The ring runs over `axis`:
  // the tsp axis, or for scheme C with experts over dp replicas the expert group (ep ranks).
  struct WeightRing {
    Tensor cur;  // shard of owner(j)
    Tensor next;
    CommRequest hop;
    Communicator* axis = nullptr;
    // At ring step j this rank holds the shard of axis rank (rank - j) mod size.
    int owner(int step) const { return ((axis->rank() - step) % axis->size() + axis->size()) % axis->size(); }
    int steps() const { return axis->size(); }
  };
  // axis: nullptr for the tsp axis (comm_).
  WeightRing weight_ring(const Tensor& own, Communicator* axis = nullptr);
  // Starts the hop that brings step j+1's shard (none after the last step).
  void weight_ring_send(WeightRing& ring, int step);
  // Finishes the hop: cur becomes the next shard.
  void weight_ring_advance(WeightRing& ring, int step);

  // Gradients travelling home behind the weights (spec 5): at step j >= 1 a rank adds its
  // partial for shard (p - j) to the accumulator received from p-1 and passes it on; after
  // D-1 hops the accumulator of shard r reaches r, which adds its own step-0 partial.
  // Built on the axis its weights travel (the tsp axis, or a MoE expert group): grad_ring().
  struct GradRing {
    Communicator& axis;
    Tensor incoming;
    Tensor sending;
    CommRequest hop;
  };
  GradRing grad_ring(Communicator& axis) { return GradRing{axis, Tensor(), Tensor(), CommRequest()}; }
  // The buffer step j's partial goes into: the gradient itself at j == 0 (accumulate with
  // beta 1), a fresh zero-free buffer (written with beta 0) otherwise.
  Tensor grad_ring_partial(Tensor& own_grad, int step, const Shape& shape);
  // After step j's partial is complete: add what arrived and pass it on.
  void grad_ring_send(GradRing& ring, int step, Tensor& partial);
  // After the last step: the accumulator of this rank's own shard arrives; add it.
  void grad_ring_finish(GradRing& ring, Tensor& own_grad);
  // Waits for the previous reduce (`request`, which read the other partial buffer), then
  // starts the reduce of partial g [attn_rows, h] f32 to rank `owner` (in place there).
  void reduce_home(CommRequest& request, Tensor& g, int owner);

  // `work` now, or, while the weight gradients are deferred (ctx_.weight_grads), queued behind
  // the products queued so far: the communication or adjustment of what they write.
  void after_products(std::function<void()> work);
  // Partial buffer i (0 or 1) of `bufs`, allocated at its first use and kept for the step:
  // the deferred products of every micro-batch write there when their W runs.
  Tensor deferred_partial(Tensor (&bufs)[2], int i, const Shape& shape);

  const TspModel& model_;
  const LlamaConfig& c_;
  const ShardDims& dims_;
  const Layout& opt_;
  Backend& be_;
  Communicator& comm_;
  int64_t batch_;        // B
  int64_t local_seq_;    // S/D
  int64_t rows_;         // T = B * S/D
  std::vector<int32_t> gathered_pos_;  // [D * S/D] every rank's rows' global positions, rank by rank
  int p_;                // this rank
  int D_;
  int64_t kvh_b_, heads_b_;  // KV heads and query heads per bucket
  // Bucket b's first KV head among the rank's: b kvh_b_, or 0 with KV replicas (shared).
  int64_t bucket_kv0(int b) const { return dims_.replicated_kv() ? 0 : b * kvh_b_; }
  // With KV replicas the units (round r, bucket b) of a KV group read one K/V: its first unit
  // projects and gathers it, its last reduce-scatters the summed dK/dV and runs the k/v backward.
  bool kv_group_first_unit(int r, int b) const {
    return !dims_.replicated_kv() || (r == dims_.kv_group_first(r) && b == 0);
  }
  bool kv_group_last_unit(int r, int b) const {
    return !dims_.replicated_kv() || (r == dims_.kv_group_last(r) && b == opt_.head_buckets - 1);
  }
  Tensor q_pos_;         // i32 [S/D]
  Tensor k_pos_;         // i32 [S], rank order
  Tensor rope_;          // [S/D, 2, d/2] at the local positions
  BlockContext ctx_;     // the local rows (B, S/D), q_pos_ and rope_ for the model's sub-blocks
  std::vector<Tensor> norm_partials_;  // attn_norm[L], mlp_norm[L], final_norm: partial gradients
  ShardedWeights variant_partials_;    // qkv_bias, o_bias, qk_norm, mlp_bias, down_bias of this step's tokens
  Tensor unit_norm_grad_;              // [2, d]: one unit's q/k norm gradient, before it joins the partial
  Tensor unit_bias_grad_;              // [heads_b d + 2 kvh_b d + h]: one unit's bias gradients, likewise
  Tensor unit_mlp_bias_grad_;          // [2 f/D + h]: one MLP chunk's gate/up (and down) bias gradients
  // Deferred weight gradients (set_weight_grads): the non-owned shards' partials, f32,
  // attention's [attn_rows, h] reduced to the owner and the MLP's [mlp_rows, h] sent round the
  // gradient ring, two of each used alternately.
  Tensor deferred_attn_[2], deferred_mlp_[2];
  KvCache* kv_cache_ = nullptr;        // prefill only
  MoeAux* moe_stats_ = nullptr;        // set_moe_stats: the micro-batch's routing statistics
  const std::vector<std::vector<double>>* moe_prob_grad_ = nullptr;  // set_moe_prob_grad
  StepTimer timer_;
};

// One micro-batch's parts of the model's step order (model/step_order.h) over `step`, which
// several micro-batches in flight may share (a pipeline stage's: parallel/pipeline/). local:
// this rank's rows [B, S/D]; grads null for a forward only; loss_normalizer as in
// TspModel::forward_backward; data_axis a MoE model's dp replicas (null: none).
std::unique_ptr<ModelStep> make_model_step(TspStep& step, const TspModel& model, const ShardedWeights& weights,
                                           const Batch& local, ShardedWeights* grads, int64_t loss_normalizer,
                                           Communicator* data_axis = nullptr);
// A local batch's shapes and ids against the model (invalid_argument naming them).
Status check_local_batch(Backend& backend, const TspModel& model, const Batch& local);

}  // namespace foldpar::tsp_detail
