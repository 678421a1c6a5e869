// Weights sharded over one axis of D ranks by attention heads, MLP columns and vocabulary
// rows: TSP's shards (docs/tsp.md section 3), and also exactly the slices Megatron tensor
// parallelism gives each rank (column-parallel Q/K/V and gate/up, row-parallel output and
// down projections, vocabulary-parallel embedding and LM head), so every strategy that
// shards weights shares this layout. Rank r owns, for every layer, the attention shard of
// its heads and the MLP shard of its columns, each PACKED in one contiguous buffer so that it
// moves in one message (TSP); the embedding and LM head are sharded by vocabulary rows; the
// norm gains are replicated. All pieces are stored as [rows, h] so that every local product is
// x [T, h] against a row block:
//   attention [Wq_r; Wk_r; Wv_r; Wo_r^T]        rows n_h/D*d + 2*n_kv/D*d + n_h/D*d
//   MLP       [Wgate_r; Wup_r; Wdown_r^T]       rows 3*f/D
// where Wq_r are the rows of q_proj for heads [r*n_h/D, (r+1)*n_h/D) (HF layout [out, in]),
// Wo_r^T the transpose of o_proj's columns for those heads, Wdown_r^T the transpose of
// down_proj's columns [r*f/D, (r+1)*f/D). The same struct holds the gradients.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "model/llama_config.h"
#include "model/llama_weights.h"
#include "model/sub_blocks.h"
#include "parallel/param_ref.h"

namespace foldpar {

// Sizes of one rank's shards; identical on every rank.
struct ShardDims {
  int degree = 1;       // D
  int64_t h = 0;
  int64_t d = 0;        // head dim
  int64_t q_rows = 0;   // n_h/D * d
  int64_t kv_rows = 0;  // kv_heads * d
  int64_t f_rows = 0;   // f/D
  int64_t v_rows = 0;   // V/D
  int64_t heads = 0;    // n_h/D
  int64_t kv_heads = 0; // n_kv/D, or 1 when n_kv < D (a replica: see kv_group)
  // Ranks that hold the same KV heads: 1 when n_kv >= D; D/n_kv when n_kv < D, where each rank's
  // n_h/D query heads all read KV head r*n_kv/D and the D/n_kv ranks r with the same
  // r / kv_group each hold an identical replica of its wk/wv rows (docs/tsp.md section 3).
  int64_t kv_group = 1;
  // MoE models on TSP (0 / 1 / 0 for a dense model). D <= E (E % D == 0): each rank owns
  // experts = E/D whole experts, expert_group 1. D > E (D % E == 0): the expert_group = D/E
  // ranks [e*D/E, (e+1)*D/E) share expert e, each owning 1 expert's slice of expert_rows =
  // f_e/(D/E) intermediate columns (gate/up rows, down columns: TSP's MLP shard of one expert).
  int64_t experts = 0;       // the (possibly sliced) routed experts each rank holds
  int64_t expert_group = 1;  // ranks that share one expert: D/E when D > E, else 1
  int64_t expert_rows = 0;   // each held expert's width: f_e / expert_group
  // The ranks the experts are spread over (the fields above are of expert_degree ranks):
  // the weight axis itself (TSP: D), or, for the Megatron baselines' expert parallelism, the
  // tp x sp group of tp*sp ranks (parallel/megatron/tp_moe.cc), wider than the tp degree.
  int expert_degree = 1;

  int64_t n_kv() const { return kv_heads * degree / kv_group; }  // the model's KV heads
  int64_t kv_head0(int r) const { return r / kv_group * kv_heads; }  // rank r's first KV head
  bool replicated_kv() const { return kv_group > 1; }
  int kv_group_first(int r) const { return static_cast<int>(r / kv_group * kv_group); }
  int kv_group_last(int r) const { return kv_group_first(r) + static_cast<int>(kv_group) - 1; }
  int64_t attn_rows() const { return 2 * q_rows + 2 * kv_rows; }
  int64_t mlp_rows() const { return 3 * f_rows; }
  int64_t attn_elems() const { return attn_rows() * h; }
  int64_t mlp_elems() const { return mlp_rows() * h; }
  int64_t vocab_elems() const { return v_rows * h; }
  // MoE: the first global expert id rank r holds (its experts are [expert0, expert0 + experts)),
  // the slice of each it holds (0 .. expert_group-1) and the first rank holding expert e
  // (e's ranks are [expert_rank0(e), expert_rank0(e) + expert_group)).
  int64_t expert0(int r) const { return expert_group > 1 ? r / expert_group : r * experts; }
  int64_t expert_slice(int r) const { return r % expert_group; }
  int expert_rank0(int64_t e) const {
    return static_cast<int>(expert_group > 1 ? e * expert_group : e / experts);
  }
};

// The shard sizes of `degree` ranks. validate_layout (layout/) is the check that n_h, f and V
// divide by the degree and n_kv either divides by it or divides it (KV replicas); here it is an
// FP_CHECK (a caller that skipped it is a bug).
// expert_degree: the ranks the experts are spread over (0: the degree itself).
ShardDims shard_dims(const LlamaConfig& config, int degree, int expert_degree = 0);

// Row offsets inside the packed buffers.
struct AttnPieces {
  Tensor wq, wk, wv, wo_t;  // views [q_rows, h], [kv_rows, h], [kv_rows, h], [q_rows, h]
};
struct MlpPieces {
  Tensor w_gate, w_up, w_down_t;  // views [f_rows, h] each
};
AttnPieces attn_pieces(const ShardDims& dims, const Tensor& packed);
MlpPieces mlp_pieces(const ShardDims& dims, const Tensor& packed);

// The part of the model a rank holds along the pipeline axis (parallel/pipeline/): decoder
// layers [first, end), the embedding (first stage), the final norm and LM head (last stage;
// with tied embeddings the last stage holds the embedding as its LM head too). Layers keep
// their global index: the per-layer vectors below have L entries, those of other stages'
// layers undefined, so names, initialization and checkpoint slices are those of the whole
// model. The default is the whole model. Under the interleaved schedule a rank holds several
// ranges (its chunks), listed in `chunks`; [first, end) is then unused.
struct StageLayers {
  int64_t first = 0;
  int64_t end = -1;  // -1: every layer
  bool embed = true;
  bool head = true;
  std::vector<std::pair<int64_t, int64_t>> chunks;  // interleaved pp: [first, end) of each; empty: one range
  bool holds_layer(int64_t l) const {
    if (chunks.empty()) return l >= first && (end < 0 || l < end);
    for (const auto& [a, b] : chunks)
      if (l >= a && l < b) return true;
    return false;
  }
};

struct ShardedWeights {
  ShardDims dims;
  int owner = 0;                  // r: the rank whose shards these are
  // The owner's rank on the expert axis (dims.expert_degree ranks; -1: owner itself, as when
  // the experts are spread over the weight axis). The Megatron baselines: sp_rank * tp + tp_rank.
  int expert_rank = -1;
  int expert_owner() const { return expert_rank < 0 ? owner : expert_rank; }
  std::vector<Tensor> attn;       // L x [attn_rows, h]
  std::vector<Tensor> mlp;        // L x [mlp_rows, h]; undefined in a MoE model's sparse layers
  // L entries, defined in the sparse layers of a MoE model only (TSP, parallel/tsp/tsp_moe.cc):
  // the owner's dims.experts routed experts, global ids from dims.expert0(owner): whole Hugging
  // Face tensors when D <= E, else slice dims.expert_slice(owner) of one expert (w_gate, w_up
  // rows and w_down columns [s*expert_rows, (s+1)*expert_rows)); the router, shared expert and
  // its gate replicated (gradients summed over the axis by the strategy).
  std::vector<MoeLayerWeights> moe;
  std::vector<Tensor> attn_norm;  // L x [h], replicated
  std::vector<Tensor> mlp_norm;   // L x [h], replicated
  // The attention variants (empty vectors when the config has none), all replicated (they are
  // small, and so a TSP rank has every head's biases at hand whichever shard it computes):
  // the q, k, v biases [bq; bk; bv] of every head, the o_proj bias [h] and the q/k norm gains
  // [2, d] (q then k). Their gradients are summed over the axis by the strategy (TSP: every
  // rank's partial over its tokens; Megatron: each tp rank's heads, over sp the tokens), so
  // every rank applies the same update.
  std::vector<Tensor> qkv_bias;   // L x [n_h d + 2 n_kv d]
  std::vector<Tensor> o_bias;     // L x [h]
  std::vector<Tensor> qk_norm;    // L x [2, d]
  // Llama's mlp_bias, replicated the same way and for the same reason: the gate and up biases
  // [b_gate; b_up] of every column (a rank applies its columns' slices, attach_mlp_bias), and
  // the down_proj bias, added once per token like the o_proj bias.
  std::vector<Tensor> mlp_bias;   // L x [2f]
  std::vector<Tensor> down_bias;  // L x [h]
  Tensor final_norm;              // [h], replicated
  Tensor embed;                   // [V/D, h] rows [r*V/D, (r+1)*V/D)
  Tensor lm_head;                 // [V/D, h]; the embed tensor when tied
  bool tied = false;
  MoeFamily moe_family = MoeFamily::kMixtral;  // the Hugging Face names of the MoE tensors

  // Tensors outside `stage` stay undefined (and everything below skips them).
  static ShardedWeights allocate(const LlamaConfig& config, const ShardDims& dims, int owner, DType dtype,
                             MemCategory category, const StageLayers& stage = {});
  // Every distinct defined tensor with a name ("layers.3.attn", "embed", ...), sharded ones first.
  void for_each(const std::function<void(const std::string& name, Tensor& t, bool replicated)>& fn);
  void zero();
};

// The MoE tensors of layer l held by this rank (none in a dense layer) under their Hugging
// Face names ("model.layers.1.block_sparse_moe.experts.2.w1.weight": global expert ids);
// `replicated` for the router, shared expert and its gate.
void for_each_moe_shard(ShardedWeights& weights, size_t layer,
                        const std::function<void(const std::string& name, Tensor& t, bool replicated)>& fn);
// The same tensors with where each lies in its global tensor: the whole tensor, or with
// experts split over D/E ranks the owner's rows of w_gate / w_up and columns of w_down.
void for_each_moe_slice(ShardedWeights& weights, size_t layer,
                        const std::function<void(const GlobalSlice& where, Tensor& t, bool replicated)>& fn);

// Fills the shards of `owner` exactly as init_weights fills the global tensors (the same
// counter-based values at the same global indices).
void init_sharded_weights(const InitOptions& options, ShardedWeights& weights);

// Copies this rank's shards out of full (single-rank) weights.
void shard_from_global(const LlamaWeights& global, ShardedWeights& shard);
// Writes one rank's shards (sharded tensors only; `replicated` also copies the norm gains)
// into their places in full weights: the inverse of shard_from_global.
void unshard_into_global(const ShardedWeights& shard, bool replicated, LlamaWeights& global);

// The gradients of a rank's ShardedWeights in ONE flat f32 buffer, ShardedWeights views into
// it: the sharded tensors first, then the attention variants' replicated gradients
// (qkv_bias, o_bias, qk_norm per layer; none without them), then the (2L+1) norm gains
// contiguous (norm_region()), so that a sum over an axis is one all_reduce (a few when it exceeds one MPI
// message; Megatron's over sp) and the gains' sum one more (over tp).
class ShardedGrads {
 public:
  static ShardedGrads allocate(const LlamaConfig& config, const ShardDims& dims, int owner, MemCategory category,
                               const StageLayers& stage = {});

  ShardedWeights& views() { return views_; }
  const ShardedWeights& views() const { return views_; }
  Tensor& flat() { return flat_; }
  Tensor norm_region() { return flat_.narrow(norm_offset_, flat_.numel()); }  // [(2L+1) h] (a stage's gains)
  // Zeroes through the Backend (every step, ShardedModel::zero_grads). Allocated zero.
  void zero(Backend& be);
  // True from zero() (and allocation) until a step accumulates into it: such a step may sum its partial in
  // place instead of through a scratch buffer.
  bool known_zero() const { return known_zero_; }
  void mark_written() { known_zero_ = false; }
  // [begin, end) of each sparse layer's routed experts in flat() (their gradients are the
  // owner's alone: under expert parallelism over tp x sp they are not summed over sp).
  const std::vector<std::pair<int64_t, int64_t>>& expert_regions() const { return expert_regions_; }

 private:
  Tensor flat_;  // f32 [every element this rank holds]
  ShardedWeights views_;
  int64_t norm_offset_ = 0;
  bool known_zero_ = false;
  std::vector<std::pair<int64_t, int64_t>> expert_regions_;
};

// A step's partial norm-gain gradients (attn_norm[L], mlp_norm[L], final_norm: each [h], in
// that order; those whose gradient in `grads` is undefined, another pipeline stage's, are left
// out) packed into one [(2L+1), h] communication buffer, summed across ranks by
// `reduce` (the strategy's own timed all_reduce over its axis), and added into the gains of
// `grads`. Collective as `reduce` is.
void sum_norm_partials(Backend& backend, const std::vector<Tensor>& partials, ShardedWeights& grads,
                       const std::function<void(Tensor& packed)>& reduce);

// A step's partial gradients of the replicated attention variants (qkv_bias, o_bias (when
// with_o_bias), qk_norm of every layer; f32, zeroed) and MLP biases (mlp_bias; down_bias
// when with_o_bias), in a ShardedWeights that holds nothing else, so attach_attn_variants
// and attach_mlp_bias give views into it. Kept apart from the gradients, which
// hold earlier micro-batches' sums, until sum_variant_partials.
ShardedWeights allocate_variant_partials(Backend& backend, const LlamaConfig& config, const ShardDims& dims,
                                         bool with_o_bias);
// Packs the partials of the layers `grads` holds into one f32 buffer, sums it across ranks by
// `reduce` (the strategy's all_reduce over its axis) and adds it into grads. Collective as
// `reduce` is; issues nothing when there are no variants.
void sum_variant_partials(Backend& backend, const ShardedWeights& partials, ShardedWeights& grads,
                          const std::function<void(Tensor& packed)>& reduce);

class Communicator;
// Collective over the sharding communicator: every rank receives the full tensors assembled from
// every rank's shards (replicated tensors taken from rank 0). `global` must be allocated
// (LlamaWeights::allocate) with the config's shapes. For verification, dumps and
// checkpoints, not for training steps: it moves the whole model.
Status assemble_global(const ShardedWeights& shard, Communicator& axis, LlamaWeights& global);
// Experts spread wider than the weight axis (the Megatron baselines' tp x sp expert axis):
// after assemble_global each weight-axis group holds its own routed experts in `global` (zero
// elsewhere); their sum over `across` (the axis across the groups, sp) completes them.
// Collective over `across`; nothing issued when it is null or has one rank.
Status sum_experts_across(Communicator* across, LlamaWeights& global);


// The ParamRefs of sharded weights and their gradients: packed shards with their global
// slices; the replicated norm gains counted only when `count_replicated` (one rank of the
// axis passes true).
// The attention variants of layer l (ShardedWeights::qkv_bias, qk_norm) for the query heads
// [q_head0, q_head0 + n_q) and KV heads [kv_head0, kv_head0 + n_kv) into `w` (a no-op without them).
void attach_attn_variants(const ShardedWeights& weights, int l, int64_t q_head0, int64_t n_q, int64_t kv_head0,
                          int64_t n_kv, QkvWeights& w);

// The gate and up biases of MLP columns [col0, col0 + cols) of layer l (ShardedWeights::mlp_bias)
// into `w` (a no-op without them); the down bias is the caller's (it is added once per token).
void attach_mlp_bias(const ShardedWeights& weights, int l, int64_t col0, int64_t cols, MlpWeights& w);

// ---- KV replicas (ShardDims::kv_group > 1; docs/tsp.md section 3) ----
// The wk/wv rows [2 kv_rows, h] of a packed attention shard (or its gradient): a view.
Tensor kv_replica_rows(const ShardDims& dims, const Tensor& packed_attn);
// The rows of the group's rank `source` (a rank of `axis` in this rank's KV group) replace
// every other member's: source sends them to each member in rank order, point to point
// (kv_group - 1 messages of rows.numel() elements). Collective over this rank's KV group of
// `axis` only; other groups run their own.
Status copy_kv_replica(Communicator& axis, const ShardDims& dims, int source, Tensor& rows);
// Every member's rows (f32) become the group's sum, added in rank order on the group's first
// rank and sent back, so the replicas stay bit-identical: 2 (kv_group - 1) messages of
// rows.numel() elements. Collective over this rank's KV group of `axis`.
Status sum_kv_replicas(Backend& backend, Communicator& axis, const ShardDims& dims, Tensor& rows);

std::vector<ParamRef> sharded_param_refs(ShardedWeights& weights, ShardedWeights& grads, bool count_replicated,
                                         bool count_sharded = true);
// Inference: the ParamRefs of weights alone (ParamRef::grad undefined), for the loaders.
std::vector<ParamRef> sharded_weight_refs(ShardedWeights& weights, bool count_replicated);
// The ParamRefs of full (replicated) weights.
std::vector<ParamRef> replicated_param_refs(LlamaWeights& weights, LlamaWeights& grads, bool counted);

}  // namespace foldpar
