// The layout flags: their CLI11 declarations and their translation into options.
#include "cli_layout.h"

namespace foldpar::cli {

void add_layout_flags(CLI::App* cmd, LayoutArgs& a) {
  cmd->add_option("--layout", a.layout, "parallel layout, e.g. tsp=4, tp=2,sp=2, dp=2,tsp=2 (run under mpirun)");
  cmd->add_option("--recompute", a.recompute, "activation recomputation: none or block");
  cmd->add_option("--seq-split", a.seq_split, "sequence sharding (tsp, sp, tp x sp): zigzag or contiguous");
  cmd->add_flag("--no-overlap", a.no_overlap, "finish every transfer before the computation that follows it");
  cmd->add_flag("--keep-weights", a.keep_weights, "tsp: backward reuses the forward's attention shards");
  cmd->add_flag("--keep-kv", a.keep_kv, "tsp: backward reuses the forward's gathered K/V");
  cmd->add_option("--head-buckets", a.head_buckets, "tsp: all-gather each attention shard's K/V in this many buckets");
  cmd->add_flag("--sequence-parallel", a.sequence_parallel, "tp, tp x sp: Megatron sequence parallelism in the norm regions");
  cmd->add_option("--kv-exchange", a.kv_exchange, "sp, tp x sp: how attention exchanges K/V: allgather or ring");
}

Result<Recompute> parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::kNone;
  if (name == "block") return Recompute::kBlock;
  return invalid_argument("--recompute must be none or block, got '{}'", name);
}

Result<SeqSplit> parse_seq_split(const std::string& name) {
  if (name == "zigzag") return SeqSplit::kZigzag;
  if (name == "contiguous") return SeqSplit::kContiguous;
  return invalid_argument("--seq-split must be zigzag or contiguous, got '{}'", name);
}

Result<LayoutOptions> layout_options(const LayoutArgs& a) {
  LayoutOptions o;
  FP_ASSIGN_OR_RETURN(o.split, parse_seq_split(a.seq_split));
  if (a.kv_exchange == "allgather") {
    o.kv_exchange = LayoutOptions::KvExchange::kAllGather;
  } else if (a.kv_exchange == "ring") {
    o.kv_exchange = LayoutOptions::KvExchange::kRing;
  } else {
    return invalid_argument("--kv-exchange must be allgather or ring, got '{}'", a.kv_exchange);
  }
  FP_ASSIGN_OR_RETURN(o.recompute, parse_recompute(a.recompute));
  o.overlap = !a.no_overlap;
  o.keep_weights = a.keep_weights;
  o.keep_kv = a.keep_kv;
  o.head_buckets = a.head_buckets;
  o.sequence_parallel = a.sequence_parallel;
  return o;
}

void add_decode_layout_flags(CLI::App* cmd, DecodeLayoutArgs& a) {
  cmd->add_option("--layout", a.layout, "tsp=N (KV cache sharded by sequence) or tp=N (by heads); default tsp=<ranks>");
  cmd->add_option("--seq-split", a.seq_split, "tsp prefill: zigzag or contiguous");
  cmd->add_option("--head-buckets", a.head_buckets, "tsp prefill: all-gather each attention shard's K/V in this many buckets");
  cmd->add_flag("--no-overlap", a.no_overlap, "finish every transfer before the computation that follows it");
}

Result<LayoutOptions> decode_layout_options(const DecodeLayoutArgs& a) {
  LayoutOptions o;
  FP_ASSIGN_OR_RETURN(o.split, parse_seq_split(a.seq_split));
  o.overlap = !a.no_overlap;
  o.head_buckets = a.head_buckets;
  return o;
}

Result<std::vector<LayoutSpec>> layout_list(const std::string& text, Recompute recompute, bool bf16) {
  FP_ASSIGN_OR_RETURN(std::vector<LayoutSpec> layouts, parse_layout_list(text));
  for (LayoutSpec& l : layouts) {
    l.bf16 = l.bf16 || bf16;
    if (recompute == Recompute::kBlock) l.recompute = Recompute::kBlock;
  }
  return layouts;
}

}  // namespace foldpar::cli
