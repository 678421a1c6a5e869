// The layout flags of verify, train, bench and generate, bound to one Layout value
// (layout/layout.h): --layout in the one grammar, plus a flag per knob for those who prefer
// flags (a flag can only switch a knob on; the layout string's options do the same). Included
// by main.cc only, so that CLI11 stays in one translation unit.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>
#include <string>

#include "core/status.h"
#include "layout/layout.h"

namespace foldpar::cli {

// Under mpirun every rank parses the same flags and reaches the same verdict on them; only
// the first rank prints, so a bad flag reads as one line. The launcher's environment tells
// the rank before MPI is initialized (OpenMPI, then PMIx/PMI launchers).
inline bool is_first_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const char* v = std::getenv(var)) return std::string(v) == "0";
  }
  return true;
}

// A note on an old spelling the parser read (once per job).
inline void print_note(const std::string& note) {
  if (!note.empty() && is_first_rank()) std::fprintf(stderr, "foldpar: note: %s\n", note.c_str());
}

struct LayoutArgs {
  std::string layout;  // empty: the command's default (tsp=<ranks>, or none for verify)
  SeqSplit split = SeqSplit::kZigzag;
  Layout::KvExchange kv_exchange = Layout::KvExchange::kAllGather;
  Recompute recompute = Recompute::kNone;
  bool no_overlap = false, keep_weights = false, keep_kv = false, sequence_parallel = false;
  int head_buckets = 1;
};

inline const std::vector<std::pair<std::string, SeqSplit>> kSplitNames{{"zigzag", SeqSplit::kZigzag},
                                                                       {"contiguous", SeqSplit::kContiguous}};
inline const std::vector<std::pair<std::string, Recompute>> kRecomputeNames{{"none", Recompute::kNone},
                                                                            {"block", Recompute::kBlock}};
inline const std::vector<std::pair<std::string, Layout::KvExchange>> kKvExchangeNames{
    {"allgather", Layout::KvExchange::kAllGather}, {"ring", Layout::KvExchange::kRing}};

// A CLI11 transform from an enum's names to its value, with a one-line error naming the
// value and the choices ("'diagonal' is not one of zigzag, contiguous").
template <typename E>
CLI::Validator enum_names(const std::vector<std::pair<std::string, E>>& names) {
  std::string choices;
  for (const auto& [name, value] : names) choices += (choices.empty() ? "" : ", ") + name;
  return CLI::Validator(
      [names, choices](std::string& text) -> std::string {
        for (const auto& [name, value] : names)
          if (text == name) {
            text = std::to_string(static_cast<int>(value));
            return "";
          }
        return "'" + text + "' is not one of " + choices;
      },
      choices);
}

// --recompute alone (bench, and single-rank verify read it too).
inline void add_recompute_flag(CLI::App* cmd, Recompute& recompute) {
  cmd->add_option("--recompute", recompute, "activation recomputation: none or block")
      ->transform(enum_names(kRecomputeNames));
}

// Every layout flag (verify, train). `generation`: only those prefill reads (generate).
inline void add_layout_flags(CLI::App* cmd, LayoutArgs& a, bool generation = false) {
  cmd->add_option("--layout", a.layout,
                  generation ? "tsp=N (KV cache sharded by sequence) or tp=N (by heads); default tsp=<ranks>"
                             : "parallel layout, e.g. tsp=4, tp=2,sp=2:ring, dp=2,tsp=2:bf16 (run under mpirun; "
                               "options after ':' as the flags below)");
  cmd->add_option("--seq-split", a.split, "sequence sharding (tsp, sp): zigzag or contiguous")
      ->transform(enum_names(kSplitNames));
  cmd->add_flag("--no-overlap", a.no_overlap, "finish every transfer before the computation that follows it");
  cmd->add_option("--head-buckets", a.head_buckets, "tsp: all-gather each attention shard's K/V in this many buckets")
      ->check(CLI::PositiveNumber);
  if (generation) return;
  add_recompute_flag(cmd, a.recompute);
  cmd->add_flag("--keep-weights", a.keep_weights, "tsp: backward reuses the forward's attention shards");
  cmd->add_flag("--keep-kv", a.keep_kv, "tsp: backward reuses the forward's gathered K/V");
  cmd->add_flag("--sequence-parallel", a.sequence_parallel, "tp: Megatron sequence parallelism in the norm regions");
  cmd->add_option("--kv-exchange", a.kv_exchange, "sp: how attention exchanges K/V: allgather or ring")
      ->transform(enum_names(kKvExchangeNames));
}

// The layout the flags name: --layout (or tsp=<ranks> when it is empty), then each flag that
// is not at its default switches its knob. Prints the parser's note on an old spelling.
inline Result<Layout> layout_of(const LayoutArgs& a, int ranks) {
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
  return l;
}

// --layouts of plan and bench-layouts: several layouts, space-separated (or ';').
inline Result<std::vector<Layout>> layouts_of(const std::vector<std::string>& items) {
  std::string note;
  FP_ASSIGN_OR_RETURN(std::vector<Layout> layouts, parse_layout_list(items, &note));
  print_note(note);
  return layouts;
}

}  // namespace foldpar::cli
