// The layout flags of the program, in one place: --layout and the strategy knobs of verify,
// train and bench (LayoutArgs), generate's prefill knobs, and the --layouts lists of plan and
// bench-layouts. Everything that turns a layout's text into options lives here, so that a
// new layout value (issue 15: one Layout type, one grammar) replaces this file pair only.
// Validation of the degrees themselves is the library's (parallel/, plan/).
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "core/status.h"
#include "model/llama_model.h"
#include "parallel/sharded_model.h"
#include "plan/layout_spec.h"

namespace foldpar::cli {

// ---- flags shared by verify, train and bench: the layout and its strategy's knobs ----
struct LayoutArgs {
  std::string layout;
  std::string seq_split = "zigzag";
  std::string recompute = "none";
  std::string kv_exchange = "allgather";
  bool no_overlap = false, keep_weights = false, keep_kv = false, sequence_parallel = false;
  int head_buckets = 1;
};

void add_layout_flags(CLI::App* cmd, LayoutArgs& a);

// "none" or "block".
Result<Recompute> parse_recompute(const std::string& name);
// "zigzag" or "contiguous".
Result<SeqSplit> parse_seq_split(const std::string& name);

Result<LayoutOptions> layout_options(const LayoutArgs& a);

// ---- generate: the decoder's layout and its prefill knobs ----
struct DecodeLayoutArgs {
  std::string layout, seq_split = "zigzag";
  int head_buckets = 1;
  bool no_overlap = false;
};

void add_decode_layout_flags(CLI::App* cmd, DecodeLayoutArgs& a);
Result<LayoutOptions> decode_layout_options(const DecodeLayoutArgs& a);

// ---- plan --layouts and bench-layouts --layouts: a comma-separated list ----
// Each layout also gets bf16 storage when `bf16`, and block recomputation when `recompute`
// is kBlock (the command-wide flags).
Result<std::vector<LayoutSpec>> layout_list(const std::string& text, Recompute recompute, bool bf16);

}  // namespace foldpar::cli
