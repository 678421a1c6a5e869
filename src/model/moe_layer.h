// The mixture-of-experts layer on one device: the router, softmax then top-k routing
// (Backend::moe_route_forward), the dispatch of each token to its k experts, each expert a
// gated MLP (mlp_forward over the rows routed to it, one GEMM group per expert), the
// weighted combine, and Qwen2-MoE's shared expert with its sigmoid gate; forward and the
// hand-written backward. Dropless by default: every routed token is computed; with a
// capacity factor the pairs beyond an expert's capacity are dropped (moe_drop_over_capacity).
// Pure math over a Backend.
//
// Routing reaches the host once per layer: the k expert ids of every token come out
// (copy_to_host) to size the per-expert groups, and the dispatch order goes back in
// (copy_from_host): tokens sorted by expert, stably, so each expert's rows keep token order.
//
// The auxiliary load-balancing loss (Hugging Face's load_balancing_loss_func): over the N =
// (sparse layers) x T routed rows of a step, aux = E * sum_e (C_e / N) * (P_e / N), with C_e
// the top-k choices of expert e and P_e its summed router probability; the loss adds
// router_aux_loss_coef * aux when output_router_logits. C is not differentiable, so the
// gradient on every p[t, e] is coef * E * C_e / N^2, one value per expert (MoeAux). The
// per-layer mode (MoeConfig::aux_per_layer) sums E * sum_e (C_le / T)(P_le / T) over the
// sparse layers l instead, with gradient coef * E * C_le / T^2 in layer l.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "model/llama_weights.h"
#include "model/sub_blocks.h"

namespace foldpar {

// The routing statistics of one step, per sparse layer, and the aux loss made of them.
struct MoeAux {
  int64_t experts = 0;                        // E
  std::vector<std::vector<int64_t>> counts;   // [sparse layers][E] top-k choices
  std::vector<std::vector<double>> prob_sums; // [sparse layers][E] summed probabilities
  std::vector<int64_t> rows;                  // [sparse layers] routed rows T
  // [sparse layers] token-expert pairs of those rows dropped over an expert's capacity
  // (MoeConfig::capacity_factor; 0 when dropless), counted like `counts`.
  std::vector<int64_t> dropped;

  MoeAux(int64_t experts, int64_t sparse_layers);
  // E * sum_e (C_e / N) (P_e / N) over every sparse layer recorded (0 when none), or with
  // per_layer the sum over layers of each layer's own.
  double loss(bool per_layer) const;
  // d(coef * loss) / d p[t, e] of the routed rows of each sparse layer: [sparse layers][E]
  // (every row the same without per_layer).
  std::vector<std::vector<double>> prob_grad(double coef, bool per_layer) const;
  // The tokens each expert received, summed over the layers: the metrics' load.
  std::vector<int64_t> load() const;
  // The pairs dropped over capacity, summed over the layers: the metrics' moe_dropped.
  int64_t dropped_pairs() const;

  // The statistics as one f64 vector, per sparse layer E counts (exact in f64), E
  // probability sums, the rows and the dropped pairs: packed_size() = sparse layers x
  // (2E + 2). What the
  // sharded strategies all-reduce, and what a pipeline stage hands the next with a
  // micro-batch (parallel/pipeline/).
  int64_t packed_size() const { return static_cast<int64_t>(counts.size()) * (2 * experts + 2); }
  std::vector<double> pack() const;
  // The inverse of pack (v.size() == packed_size()).
  void unpack(const std::vector<double>& v);
  // prob_grad's [sparse layers][E] as one vector of sparse layers x E, and back.
  static std::vector<double> flatten(const std::vector<std::vector<double>>& g);
  std::vector<std::vector<double>> unflatten(const std::vector<double>& v) const;
};

struct MoeSaved {
  Tensor probs;              // [T, E] router probabilities
  Tensor weights;            // [T, k] routing weights
  Tensor experts;            // i32 [T, k] expert ids
  Tensor token_rows;         // i32 [M] the token of each dispatched row, M = T * k, grouped by expert
  Tensor slot_rows;          // i32 [M] its (t * k + j) slot in weights
  Tensor identity_rows;      // i32 [T] 0..T-1 (the shared gate's row scale)
  std::vector<int64_t> offsets;  // [E + 1] first dispatched row of each expert
  Tensor dispatched;         // [M, h] the normed input rows, grouped by expert
  Tensor row_weights;        // [M, 1] each dispatched row's routing weight
  Tensor expert_out;         // [M, h] each dispatched row's expert output (unweighted)
  std::vector<MlpSaved> expert_mlp;  // E: gate, up, act of its rows
  Tensor shared_out;         // [T, h] the shared expert's output before its gate
  Tensor shared_gate;        // [T, 1] sigmoid(a Wsg^T)
  MlpSaved shared_mlp;
};

// The capacity limit (MoeConfig::moe_capacity_factor) on the host expert ids of T = batch x seq
// tokens (t-major, k per token, sequence-major rows): in each sequence, expert e keeps its
// first `capacity` pairs in position order (a token's k slots in rank order) and every later
// pair's id becomes kDroppedExpert. Returns the pairs dropped; capacity 0 drops none.
inline constexpr int32_t kDroppedExpert = -1;
int64_t moe_drop_over_capacity(std::vector<int32_t>& experts, int64_t batch, int64_t seq, int64_t k, int64_t E,
                               int64_t capacity);

// How many of the ids `experts` chose each of the E experts (dropped ids not counted): the
// aux statistics' counts, taken before any capacity drop.
std::vector<int64_t> moe_expert_choices(const std::vector<int32_t>& experts, int64_t E);
// How many of the ids are kDroppedExpert: after the drop, the pairs it dropped.
int64_t moe_dropped_count(const std::vector<int32_t>& experts);

// The T * k slots of `experts` (i32 ids, t-major) sorted by expert, stably (token order
// within an expert): offsets [E + 1], and per dispatched row its token and slot. Slots
// dropped over capacity (kDroppedExpert) are not dispatched. Every layout's dispatch order.
void moe_dispatch_order(const std::vector<int32_t>& experts, int64_t k, int64_t E, std::vector<int64_t>& offsets,
                        std::vector<int32_t>& token_rows, std::vector<int32_t>& slot_rows);

// a: [T, h] the normed input; y: [T, h] accumulated (+=, it holds the residual). When
// `aux` is given the layer's routing statistics are recorded there (row w.sparse_index).
// `saved` (may be null) receives what moe_backward needs.
void moe_forward(const BlockContext& ctx, const MoeLayerWeights& w, const Tensor& a, Tensor& y, MoeSaved* saved,
                 MoeAux* aux);

// dy: [T, h]. d_a (+)= the input gradient [T, h] (allocated when undefined); g += the weight
// gradients. `prob_grad`, when not empty, is MoeAux::prob_grad ([E]): the aux loss's.
void moe_backward(const BlockContext& ctx, const MoeLayerWeights& w, const MoeSaved& s, const Tensor& a,
                  const Tensor& dy, Tensor& d_a, MoeLayerWeights& g, const std::vector<double>& prob_grad);

// Pieces the layer shares with its sharded forms (parallel/tsp/tsp_moe.cc,
// parallel/megatron/tp_moe.cc): host ids as a tensor of the backend (nothing moves for an
// empty list), the context of one expert's group of `rows` dispatched rows, and an expert as
// the gated MLP the sub-blocks run.
Tensor moe_upload_i32(Backend& be, const std::vector<int32_t>& v);
BlockContext moe_group_context(const BlockContext& ctx, int64_t rows);
MlpWeights expert_mlp_weights(const ExpertWeights& e);

// The backward's pieces that do not depend on where the experts live (every strategy runs
// them on its own T token rows; a sharded one then sums the replicated weights' gradients).
//
// The combine's adjoint (y += sum_j w_j expert_out_j): returns d(out) [M, h] of each
// dispatched row (dy of its token times its routing weight) and adds each row's
// <dy, expert_out> into its slot of d_weights_rows [M, 1].
Tensor moe_combine_backward(Backend& be, const MoeSaved& s, const Tensor& dy, Tensor& d_weights_rows);
// The router's: d_weights [T, k] back through top-k and the softmax (plus the aux loss's
// gradient `prob_grad` [E], when not empty) to the logits a Wr^T; d_a += d_logits Wr,
// d_router = d_logits^T a + beta d_router.
void moe_router_backward(Backend& be, const MoeConfig& m, const MoeLayerWeights& w, const MoeSaved& s, const Tensor& a,
                         const Tensor& d_weights, const std::vector<double>& prob_grad, Tensor& d_a, Tensor& d_router,
                         float beta);
// The shared expert's and its gate's (y += sigmoid(a Wsg^T) * shared(a)): d_a += both
// paths, d_gate = d(Wsg) + beta d_gate, `d_shared` += the shared expert's weight gradients.
void moe_shared_backward(const BlockContext& ctx, const MoeLayerWeights& w, const MoeSaved& s, const Tensor& a,
                         const Tensor& dy, Tensor& d_a, Tensor& d_gate, float beta, MlpWeights& d_shared);
// Both of the above for a sharded strategy, whose router and shared expert are replicated:
// this rank's rows' gradients go into fresh f32 buffers and `sum_into(partial, grad)` adds
// each into g (over the strategy's axis). prob_grads: MoeAux::prob_grad per sparse layer
// (empty: no aux loss).
void moe_replicated_backward(const BlockContext& ctx, const MoeLayerWeights& w, const MoeSaved& s, const Tensor& a,
                             const Tensor& dy, const Tensor& d_weights,
                             const std::vector<std::vector<double>>& prob_grads, Tensor& d_a, MoeLayerWeights& g,
                             const std::function<void(Tensor& partial, Tensor& grad)>& sum_into);

}  // namespace foldpar
