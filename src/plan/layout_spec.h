// LayoutSpec: one parallel layout and its strategy's knobs, as the planner and the layout
// benchmark name it: "tsp=4", "tp=2:seqpar", "sp=2:ring", "tp=2+sp=2", "dp=2+tsp=4:bf16".
// Axes are joined by '+' (',' separates layouts in a list); options follow ':'. Pure
// parsing and arithmetic: no MPI, no strategy code (parallel/ validates the same sizes
// again when it builds a model).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/llama_model.h"

namespace foldpar {

enum class PlanStrategy { kTsp, kTp, kSp, kTpSp };

struct LayoutSpec {
  int dp = 1, tp = 1, sp = 1, tsp = 1;  // axis degrees; absent axes are 1
  PlanStrategy strategy = PlanStrategy::kTsp;
  // Options (parallel/sharded_model.h LayoutOptions): ":ring" sp K/V ring exchange,
  // ":seqpar" Megatron sequence parallelism, ":nooverlap", ":keepw" / ":keepkv" TSP keep
  // policies, ":buckets=N" TSP head buckets, ":recompute" Recompute::kBlock, ":bf16" storage.
  bool ring = false;
  bool sequence_parallel = false;
  bool overlap = true;
  bool keep_weights = false;
  bool keep_kv = false;
  int head_buckets = 1;
  Recompute recompute = Recompute::kNone;
  // bf16 storage is planned for every layout (what the layout would hold and move in
  // bf16, statistics and gradients f32); this build runs it on tsp only.
  bool bf16 = false;

  int model_ranks() const { return tp * sp * tsp; }  // ranks of one model replica
  int ranks() const { return dp * model_ranks(); }
  int storage_bytes() const { return bf16 ? 2 : 4; }  // beta of weights and activations
  // The mesh string comm/mesh.h parses: "dp=2,tp=2,sp=2" (model axes as written).
  std::string mesh() const;
  // The spec again, canonical: axes in the order dp, tp, sp, tsp, then the options.
  std::string name() const;
};

// invalid_argument naming the offending text for unknown axes or options, degrees below 1,
// tsp combined with tp or sp, and a layout without any axis.
Result<LayoutSpec> parse_layout_spec(const std::string& text);
// A comma-separated list of specs.
Result<std::vector<LayoutSpec>> parse_layout_list(const std::string& text);

// The divisibility the strategies require (parallel/*: heads, KV heads, f and V by the
// weight-sharding degree; S by 2x the sequence degree for zigzag, by T with seqpar; head
// buckets dividing the KV heads per TSP rank; B by dp), checked without building anything.
// invalid_argument naming the numbers.
Status check_layout_sizes(const LlamaConfig& config, const LayoutSpec& layout, int64_t batch, int64_t seq);

// Elements of the parameters one rank holds (its weight shards, or the whole model where
// weights are replicated): the size of its gradients and of each AdamW moment.
int64_t local_parameter_elements(const LlamaConfig& config, const LayoutSpec& layout);
// The degree weights are sharded by: tsp, tp, or 1 (sp).
int weight_degree(const LayoutSpec& layout);
// The degree tokens are sharded by inside a replica: tsp, sp, or 1 (tp without seqpar).
int token_degree(const LayoutSpec& layout);

}  // namespace foldpar
