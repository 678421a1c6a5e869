// The layout flags of the program, in one place, bound to the one Layout value
// (layout/layout.h): --layout in the one grammar plus a flag per knob (verify, train), the
// prefill knobs of generate, and the --layouts lists of plan and bench-layouts. A knob flag
// can only switch its knob on, as the layout string's ':' options do. Whether a layout can
// run is validate_layout's business (the library), not this file's.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "core/status.h"
#include "layout/layout.h"

namespace foldpar::cli {

struct LayoutArgs {
  std::string layout;  // empty: the command's default (tsp=<ranks>; none for verify)
  SeqSplit split = SeqSplit::kZigzag;
  Layout::KvExchange kv_exchange = Layout::KvExchange::kAllGather;
  Recompute recompute = Recompute::kNone;
  bool no_overlap = false, keep_weights = false, keep_kv = false, sequence_parallel = false;
  int head_buckets = 1;
  Layout::MoeDispatchOption moe_dispatch = Layout::MoeDispatchOption::kAuto;
  std::vector<int> stage_layers;  // pp: --stage-layers 5,6,6,5
  std::string schedule;           // pp: --schedule 1f1b | interleaved:V | zb (Layout::chunks, zero_bubble); empty: the layout's
};

// Every layout flag (verify, train). `generation`: --layout and the prefill knobs only
// (generate: split, head buckets, overlap).
void add_layout_flags(CLI::App* cmd, LayoutArgs& a, bool generation = false);

// The layout the flags name: --layout (tsp=<ranks> when empty), then each knob flag that is
// not at its default switches its knob. Prints the parser's note on an old spelling.
Result<Layout> layout_of(const LayoutArgs& a, int ranks);

// plan --layouts and bench-layouts --layouts: layouts as separate arguments (or ';'); each
// also gets bf16 storage when `bf16`, and block recomputation when `recompute` is kBlock
// (the command-wide flags). Prints the parser's note on an old spelling.
Result<std::vector<Layout>> layout_list(const std::vector<std::string>& items, Recompute recompute, bool bf16);

}  // namespace foldpar::cli
