// The layout flags: their CLI11 declarations and the Layout they name.
#include "cli_layout.h"

#include <cstdio>

#include "cli.h"

namespace foldpar::cli {
namespace {

void print_note(const std::string& note) {
  if (!note.empty() && is_first_rank()) std::fprintf(stderr, "foldpar: note: %s\n", note.c_str());
}

}  // namespace

void add_layout_flags(CLI::App* cmd, LayoutArgs& a, bool generation) {
  cmd->add_option("--layout", a.layout,
                  generation ? "tsp=N (KV cache sharded by sequence) or tp=N (by heads); default tsp=<ranks>"
                             : "parallel layout: axes joined by ',', options after ':', e.g. tsp=4, "
                               "tp=2,sp=2:ring, dp=2,tsp=2:bf16 (run under mpirun)");
  cmd->add_option("--seq-split", a.split, generation ? "tsp prefill: zigzag or contiguous"
                                                     : "sequence sharding (tsp, sp): zigzag or contiguous")
      ->transform(choice<SeqSplit>({{"zigzag", SeqSplit::kZigzag}, {"contiguous", SeqSplit::kContiguous}}));
  cmd->add_option("--head-buckets", a.head_buckets, "tsp: all-gather each attention shard's K/V in this many buckets")
      ->check(positive());
  if (!generation)
    cmd->add_option("--moe-dispatch", a.moe_dispatch,
                    "tsp, MoE models: a2a (all-to-all), gather (all-gather + reduce-scatter), ring (expert weights "
                    "circulate) or auto (ring iff local tokens > 2.25 E f_e / k, else gather iff the expert ranks (tsp, "
                    "or ep) < k, else a2a)")
        ->transform(choice<Layout::MoeDispatchOption>({{"auto", Layout::MoeDispatchOption::kAuto},
                                                       {"a2a", Layout::MoeDispatchOption::kAllToAll},
                                                       {"gather", Layout::MoeDispatchOption::kGather},
                                                       {"ring", Layout::MoeDispatchOption::kRing}}));
  cmd->add_flag("--no-overlap", a.no_overlap, "finish every transfer before the computation that follows it");
  if (generation) return;
  add_recompute_option(cmd, a.recompute);
  cmd->add_flag("--keep-weights", a.keep_weights, "tsp: backward reuses the forward's attention shards");
  cmd->add_flag("--keep-kv", a.keep_kv, "tsp: backward reuses the forward's gathered K/V");
  cmd->add_option("--stage-layers", a.stage_layers, "pp: decoder layers of each stage, first first, e.g. 5,6,6,5")
      ->delimiter(',');
  cmd->add_option("--schedule", a.schedule,
                  "pp: 1f1b, interleaved:V (V model chunks per rank, rank s holding chunks s, s+p, ...; m a "
                  "multiple of p), or zb (ZB-H1: weight gradients deferred into the bubble)");
  cmd->add_flag("--sequence-parallel", a.sequence_parallel, "tp: Megatron sequence parallelism in the norm regions");
  cmd->add_option("--kv-exchange", a.kv_exchange, "sp: how attention exchanges K/V: allgather or ring")
      ->transform(choice<Layout::KvExchange>(
          {{"allgather", Layout::KvExchange::kAllGather}, {"ring", Layout::KvExchange::kRing}}));
}

Result<Layout> layout_of(const LayoutArgs& a, int ranks) {
  std::string note;
  Result<Layout> parsed = a.layout.empty() ? Result<Layout>(tsp_layout(ranks)) : parse_layout(a.layout, &note);
  FP_RETURN_IF_ERROR(parsed.status());
  print_note(note);
  Layout l = *parsed;
  if (a.split != SeqSplit::kZigzag) l.split = a.split;
  if (a.kv_exchange != Layout::KvExchange::kAllGather) l.kv_exchange = a.kv_exchange;
  if (a.recompute != Recompute::kNone) l.recompute = a.recompute;
  if (a.no_overlap) l.overlap = false;
  if (a.keep_weights) l.keep_weights = true;
  if (a.keep_kv) l.keep_kv = true;
  if (a.sequence_parallel) l.sequence_parallel = true;
  if (a.head_buckets != 1) l.head_buckets = a.head_buckets;
  if (a.moe_dispatch != Layout::MoeDispatchOption::kAuto) l.moe_dispatch = a.moe_dispatch;
  if (!a.stage_layers.empty()) l.stage_layers = a.stage_layers;
  if (!a.schedule.empty()) {
    FP_ASSIGN_OR_RETURN(const PipelineSchedule schedule, parse_schedule(a.schedule));
    l.chunks = schedule.chunks;
    l.zero_bubble = schedule.zero_bubble;
  }
  return l;
}

Result<std::vector<Layout>> layout_list(const std::vector<std::string>& items, Recompute recompute, bool bf16) {
  std::string note;
  FP_ASSIGN_OR_RETURN(std::vector<Layout> layouts, parse_layout_list(items, &note));
  print_note(note);
  for (Layout& l : layouts) {
    if (bf16) l.dtype = DType::kBF16;
    if (recompute == Recompute::kBlock) l.recompute = Recompute::kBlock;
  }
  return layouts;
}

}  // namespace foldpar::cli
