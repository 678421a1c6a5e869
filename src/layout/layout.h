// Layout: one parallel layout of a job, every axis and every strategy knob, as every command,
// the plan and the strategies see it. One grammar (parse_layout), one canonical spelling
// (to_string) and one divisibility check (validate_layout), so the plan and the strategies
// cannot disagree about what runs. Pure values and arithmetic: no MPI, no strategy code.
//
// Grammar (canonical): axes as `name=degree` joined by ',', then options each after ':':
//   tsp=4          dp=2,tsp=4:bf16          tp=2,sp=2:ring:seqpar          sp=4:contiguous
// Axes: dp (data), pp (pipeline), tp (tensor), sp (sequence), tsp (tensor-and-sequence),
// ep (the ranks a MoE model's expert group spans; no mesh axis, written last: dp=2,tp=2,ep=4).
// Options: ring (K/V around the sp ring instead of an all-gather), seqpar
// (Megatron sequence-parallel norms), contiguous (sequence split; zigzag by default),
// nooverlap, keepw / keepkv (TSP backward policies), buckets=N (TSP head buckets),
// recompute (Recompute::kBlock), bf16 (storage dtype), stages=A/B/.. (pp: layers per stage),
// interleaved=V (pp: the interleaved 1F1B schedule over V chunks per rank; train --schedule),
// zb (pp: the zero-bubble ZB-H1 schedule; train --schedule zb),
// moe=a2a|gather|ring|auto (tsp, MoE models: how tokens meet their experts; parallel/tsp/tsp_moe.cc).
// The old plan spelling with '+' between axes ("tp=2+sp=2") is still read, with a note
// naming the canonical form.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "model/llama_config.h"
#include "model/llama_model.h"
#include "tensor/dtype.h"

namespace foldpar {

// How tokens are sharded on a sequence axis (tsp, sp): zigzag cuts S into 2D chunks and
// rank p holds c_p and c_{2D-1-p} (balanced causal work); contiguous gives rank p the p-th
// block of S/D (parallel/sequence_shard.h).
enum class SeqSplit { kZigzag, kContiguous };

// Which family of strategy runs the model axes. kTsp: tsp=D (parallel/tsp/). kMegatron: tp=T
// and/or sp=S, either possibly 1 (the baselines).
enum class Strategy { kTsp, kMegatron };

struct Layout {
  // ---- axes (degrees >= 1; an axis not written has degree 1) ----
  int dp = 1;   // data-parallel replicas (the training loop's axis)
  int pp = 1;   // pipeline stages (parallel/pipeline/; composes with every model axis and dp)
  int tsp = 1;  // TSP degree D: 1/D of the weights and of the tokens per rank
  int tp = 1;   // Megatron tensor-parallel degree
  int sp = 1;   // sequence (context) parallel degree
  // A MoE model's expert group: ep = K G ranks, G the model group (tsp=D: D; tp/sp: tp sp) and
  // K consecutive dp replicas (experts over dp too); 1 (or G): the model group itself.
  int ep = 1;
  Strategy strategy = Strategy::kTsp;  // kTsp when tsp is written, else kMegatron

  // ---- strategy knobs (each applies where said; validate_layout refuses a knob set on a
  // layout it does not apply to) ----
  SeqSplit split = SeqSplit::kZigzag;  // tsp, sp
  enum class KvExchange { kAllGather, kRing };
  KvExchange kv_exchange = KvExchange::kAllGather;  // sp: how attention exchanges K/V
  // tp: Megatron sequence parallelism in the norm regions (all_gather before the
  // column-parallel GEMMs, reduce_scatter after the row-parallel ones).
  bool sequence_parallel = false;
  // Start transfers before the computation that does not need them yet (double buffers);
  // false: every transfer completes before the computation that follows it.
  bool overlap = true;
  bool keep_weights = false;  // tsp backward: reuse the forward's broadcast attention shards
  bool keep_kv = false;       // tsp backward: reuse the forward's gathered K/V
  int head_buckets = 1;       // tsp: all-gather each attention shard's K/V in this many buckets
  Recompute recompute = Recompute::kNone;
  // Storage of weights and activations and what travels of them: f32, or bf16 (then run on
  // a bf16 storage backend; gradients, statistics and AdamW stay f32).
  DType dtype = DType::kF32;
  // pp: the decoder layers of each stage, first stage first (sum L); empty: stage_layers()
  // balances them (`--stage-layers 5,6,6,5`, or `:stages=5/6/6/5` in the layout string).
  std::vector<int> stage_layers;
  // pp: model chunks per rank, v (parallel/pipeline/pipeline_schedule.h). 1: the 1F1B
  // schedule over contiguous stages; V > 1: interleaved 1F1B, the L layers cut into p V
  // chunks and rank s holding chunks s, s + p, ..., s + (V-1) p (`--schedule interleaved:V`,
  // or `:interleaved=V` in the layout string). Not with stage_layers.
  int chunks = 1;
  // pp: the zero-bubble schedule ZB-H1 (parallel/pipeline/pipeline_schedule.h): each backward
  // split into the input gradient and the weight gradients, these deferred into the bubble
  // (`--schedule zb`, or `:zb` in the layout string). Contiguous stages (chunks 1), of any
  // strategy.
  bool zero_bubble = false;
  // tsp with a MoE model: all-to-all dispatch and combine (a2a), all-gather of the tokens with a
  // reduce-scatter of the outputs (gather), the expert-weight ring (ring), or auto: spec
  // COMPOSITION.md 3's training break-evens, ring iff T > 2.25 E f_e / k, else gather iff D < k,
  // else a2a (T = B S / D local rows).
  enum class MoeDispatchOption { kAuto, kAllToAll, kGather, kRing };
  MoeDispatchOption moe_dispatch = MoeDispatchOption::kAuto;

  // ---- not part of the layout's name: a verification request ----
  bool keep_logits = false;  // also return this rank's logits rows [B, S_local, V]

  int model_ranks() const { return pp * tsp * tp * sp; }  // ranks of one model replica
  int ranks() const { return dp * model_ranks(); }
  // MoE: the ranks the routed experts spread over (ep, or the model group when ep is 1), and
  // the dp replicas one expert group spans (K = expert_ranks() / the model group).
  int expert_group_ranks() const { return strategy == Strategy::kTsp ? tsp : tp * sp; }
  int expert_ranks() const { return ep > 1 ? ep : expert_group_ranks(); }
  int expert_replicas() const { return expert_ranks() / expert_group_ranks(); }
  int storage_bytes() const { return dtype == DType::kBF16 ? 2 : 4; }  // beta
  // The degree weights are sharded by (tsp, tp, or 1 for sp) and the degree tokens are
  // sharded by inside a replica (tsp, sp, or 1 for tp without sequence parallelism).
  int weight_degree() const { return strategy == Strategy::kTsp ? tsp : tp; }
  int token_degree() const { return strategy == Strategy::kTsp ? tsp : sp; }

  // The mesh string comm/mesh.h parses, in the canonical rank order (outermost first):
  // "dp=2,tsp=4", "tp=2,sp=2". Axes of degree 1 are left out, except the strategy's own
  // axis (tsp for TSP; tp when both Megatron degrees are 1).
  std::string mesh() const;
  // The canonical spelling: mesh() then the options that differ from the defaults, in the
  // order of the grammar above. parse_layout(to_string()) gives the same layout back.
  std::string to_string() const;

  bool operator==(const Layout&) const = default;
};

// tsp=D with default knobs: what a job without --layout runs on D ranks.
Layout tsp_layout(int degree);

// Parses one layout. invalid_argument naming the text for unknown axes or options, degrees
// that are not positive integers, repeated axes, tsp with tp or sp, and no model axis
// (dp=2 alone: write dp=2,tsp=1).
// `note`, when given, receives a one-line note where an old spelling was read ('+').
Result<Layout> parse_layout(std::string_view text, std::string* note = nullptr);

// A pipeline schedule (`train --schedule`): "1f1b" (1 chunk per rank), "interleaved:V" (V
// chunks, Layout::chunks) or "zb" (ZB-H1, Layout::zero_bubble).
struct PipelineSchedule {
  int chunks = 1;
  bool zero_bubble = false;
  bool operator==(const PipelineSchedule&) const = default;
};
// invalid_argument naming the text for anything else.
Result<PipelineSchedule> parse_schedule(std::string_view text);
// The schedule's name as `--schedule` spells it: "1f1b", "interleaved:V" or "zb".
std::string schedule_name(const Layout& layout);

// Several layouts: each item is one layout; an item may also hold several separated by ';'.
// An item in the old list spelling ("tsp=2,tp=2+sp=2:ring", layouts between commas, axes
// between '+') is read with a note giving the canonical list.
Result<std::vector<Layout>> parse_layout_list(const std::vector<std::string>& items, std::string* note = nullptr);

// The only divisibility and applicability check in foldpar: the plan calls it for every
// candidate, and every strategy before it allocates. `batch` 0 means not known yet (a
// strategy is built for any batch) and `seq` 0 the same (a decoder, whose prefill pads the
// prompts): those checks are skipped. invalid_argument naming the numbers, e.g.
// "tsp=3: num_attention_heads (4) must be divisible by the TSP degree (3)"; unimplemented
// for axes foldpar lacks.
Status validate_layout(const LlamaConfig& config, const Layout& layout, int64_t batch, int64_t seq);

// pp: the layers before each chunk and after the last, [p v + 1] bounds from 0 to L (v =
// Layout::chunks), so chunk g holds decoder layers [bounds[g], bounds[g+1]) and runs on rank
// g % p; with v = 1 the chunks are the stages. Layout::stage_layers when given (v = 1);
// otherwise balanced by cost, the forward matmul FLOPs per token (model/flop_count.h): each
// decoder layer's, the LM head's on the last stage, none for the embedding (a lookup). Every
// stage at least one decoder layer; the most expensive stage as cheap as possible, then the
// most even cut (least sum of squared costs), then the earlier stages as small as the rest
// allows (22 equal layers with a light head on 4 stages: 5,6,6,5; 8 layers and a head as
// heavy as two: 5,3 on 2 stages); the same over the p v chunks when interleaved. A function of
// (config, layout) only, so every caller (the pipeline, its decoder, the plan, parameter
// counts) cuts alike, and checkpoints, which name layers globally, do not depend on it.
// validate_layout's verdict first (L >= p v, the list sums to L).
std::vector<int64_t> stage_bounds(const LlamaConfig& config, const Layout& layout);

// pp: the micro-batches of one optimizer step (m, per data-parallel rank) must be at least
// the stages (p), or the pipeline never fills, and a multiple of p under the interleaved
// schedule (chunks > 1); invalid_argument naming m and p. Any m for pp=1.
Status validate_micro_batches(const Layout& layout, int64_t micro_batches);

// Elements of the parameters one rank of pipeline stage `stage` holds (its weight shards, or
// the whole stage where weights are replicated): the size of its gradients and of each AdamW
// moment. A stage holds its decoder layers (stage_bounds: its chunks), stage 0 the embedding and the last
// stage the final norm and the LM head (with tied embeddings, a copy of the embedding).
int64_t local_parameter_elements(const LlamaConfig& config, const Layout& layout, int stage = 0);

// The dispatch `moe=auto` runs without a plan (tsp_moe.cc): the training bytes break-evens
// of spec COMPOSITION.md 3 at T tokens per rank on D ranks, with G = D/E ranks per expert
// when D > E (else 1; docs/composition.md section 3): the expert ring iff
// T > 2.25 E f_e / (k G), else the all-gather iff D < k G, else the all-to-all. Never kAuto.
// `foldpar plan` times each scheme instead (plan/planner.h, LayoutPlan::moe).
Layout::MoeDispatchOption moe_dispatch_by_bytes(const MoeConfig& moe, int64_t tokens_per_rank, int degree);

}  // namespace foldpar
