// validate_layout: the one place that decides whether a layout can run a model at (B, S).
// The plan calls it for every candidate and every strategy before it allocates, so the
// plan's verdict and the strategy's are the same by construction (tests/unit/layout_test.cc
// holds them together over a grid).
#include <fmt/format.h>

#include "layout/layout.h"

namespace foldpar {
namespace {

Status check_axes(const Layout& l, const std::string& name) {
  const std::pair<const char*, int> axes[] = {{"dp", l.dp}, {"pp", l.pp}, {"tsp", l.tsp},
                                              {"tp", l.tp}, {"sp", l.sp}, {"ep", l.ep}};
  for (const auto& [axis, degree] : axes)
    if (degree < 1) return invalid_argument("{}: the degree of {} ({}) must be positive", name, axis, degree);
  if (l.strategy == Strategy::kTsp && (l.tp > 1 || l.sp > 1))
    return invalid_argument("{}: tsp does not combine with tp or sp", name);
  if (l.strategy == Strategy::kMegatron && l.tsp > 1)
    return invalid_argument("{}: tsp does not combine with tp or sp", name);
  if (l.pp > 1) return unimplemented("{}: pipeline parallelism (pp={}) is not built yet", name, l.pp);
  if (l.ep > 1) return unimplemented("{}: expert parallelism (ep={}) is not built yet", name, l.ep);
  return Status();
}

// Knobs that only one strategy reads: set on the other, they would be silently ignored. (A
// Megatron knob on an axis of degree 1 is accepted: that axis issues no collective, so the
// knob changes nothing, as tp=2,sp=1 is tp=2.)
Status check_knobs(const Layout& l, const std::string& name) {
  const bool tsp = l.strategy == Strategy::kTsp;
  if (!tsp && (l.keep_weights || l.keep_kv || l.head_buckets != 1))
    return invalid_argument("{}: keepw, keepkv and buckets are TSP backward policies (layout tsp=N)", name);
  if (l.head_buckets < 1) return invalid_argument("{}: head buckets ({}) must be positive", name, l.head_buckets);
  if (tsp && l.kv_exchange == Layout::KvExchange::kRing)
    return invalid_argument("{}: the ring K/V exchange is the sp axis's (TSP all-gathers K/V)", name);
  if (tsp && l.sequence_parallel)
    return invalid_argument("{}: seqpar (Megatron sequence parallelism) is the tp axis's (TSP shards the sequence "
                            "already)",
                            name);
  if (l.dtype != DType::kF32 && l.dtype != DType::kBF16)
    return invalid_argument("{}: weights and activations are stored in f32 or bf16, not {}", name,
                            dtype_name(l.dtype));
  return Status();
}

Status check_sizes(const LlamaConfig& c, const Layout& l, int64_t batch, int64_t seq, const std::string& name) {
  if (batch < 0 || seq < 0) return invalid_argument("{}: batch ({}) and sequence ({}) must be positive", name, batch, seq);
  if (batch > 0 && batch % l.dp != 0)
    return invalid_argument("{}: the batch ({}) must be divisible by the data-parallel degree ({})", name, batch, l.dp);
  const int W = l.weight_degree(), Q = l.token_degree();
  const char* waxis = l.strategy == Strategy::kTsp ? "TSP" : "tp";
  const std::pair<const char*, int64_t> sharded[] = {{"num_attention_heads", c.num_attention_heads},
                                                     {"num_key_value_heads", c.num_key_value_heads},
                                                     {"intermediate_size", c.intermediate_size},
                                                     {"vocab_size", c.vocab_size}};
  for (const auto& [field, value] : sharded)
    if (value % W != 0)
      return invalid_argument("{}: {} ({}) must be divisible by the {} degree ({})", name, field, value, waxis, W);
  if (seq == 0) return Status();  // a decoder: the prefill pads the prompts to what divides
  if (Q > 1 && l.split == SeqSplit::kZigzag && seq % (2 * Q) != 0)
    return invalid_argument("{}: the sequence length ({}) must be divisible by 2 x the sequence degree (2 x {} = {}) for the "
                            "zigzag split",
                            name, seq, Q, 2 * Q);
  if (Q > 1 && l.split == SeqSplit::kContiguous && seq % Q != 0)
    return invalid_argument("{}: the sequence length ({}) must be divisible by the sequence degree ({})", name, seq, Q);
  if (l.sequence_parallel && (seq / Q) % l.tp != 0) {
    if (Q > 1)
      return invalid_argument("{}: the sequence length ({}) must be divisible by the sp degree x the tp degree ({} x {} = "
                              "{}) with sequence parallelism (the local sequence {} by {})",
                              name, seq, Q, l.tp, Q * l.tp, seq / Q, l.tp);
    return invalid_argument("{}: the sequence length ({}) must be divisible by the tp degree ({}) with sequence "
                            "parallelism",
                            name, seq, l.tp);
  }
  if (l.strategy == Strategy::kTsp && (c.num_key_value_heads / l.tsp) % l.head_buckets != 0)
    return invalid_argument("{}: head buckets ({}) must divide the KV heads per TSP rank ({} = {} / {})", name,
                            l.head_buckets, c.num_key_value_heads / l.tsp, c.num_key_value_heads, l.tsp);
  return Status();
}

}  // namespace

Status validate_layout(const LlamaConfig& config, const Layout& layout, int64_t batch, int64_t seq) {
  FP_RETURN_IF_ERROR(config.validate());
  const std::string name = layout.to_string();
  // The MoE layer runs in the single-rank model only (model/moe_layer.h, parallel/single_rank_model.h).
  if (config.moe.enabled() && (layout.ranks() != 1 || layout.dtype != DType::kF32))
    return unimplemented("layout {}: mixture-of-experts models ({}, {} experts) run on one rank in f32 only so far",
                         name, config.moe.model_type(), config.moe.num_experts);
  FP_RETURN_IF_ERROR(check_axes(layout, name));
  FP_RETURN_IF_ERROR(check_knobs(layout, name));
  return check_sizes(config, layout, batch, seq, name);
}

}  // namespace foldpar
