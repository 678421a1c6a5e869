// Layouts side by side, measured and predicted: `foldpar bench-layouts` and
// bench/layout_bench. For each sequence length, repetitions interleave the layouts (one
// training step each, forward + backward, timed after `warmup` untimed steps of the same model
// so that first-touch page faults and the GEMM library's first-call setup are not in it; the
// tracked peak is the first step's, from before the model exists); each row gives the
// medians of the step time (slowest rank) and tokens/s, the exposed communication time
// (rank 0), the tracked peak per rank (worst rank) and the bytes sent on the model axes
// (pp's boundary included; worst rank), beside what src/plan predicts for the same layout. (`foldpar calibrate` is
// app/calibrate.h.)
//
// Every function taking a Communicator is collective over it: all ranks call it with the
// same options.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/status.h"
#include "model/llama_config.h"
#include "parallel/sharded_model.h"
#include "plan/hardware.h"
#include "plan/layout_spec.h"

namespace foldpar {

struct LayoutBenchOptions {
  LlamaConfig config;
  std::vector<Layout> layouts;  // each must use every rank of the communicator
  std::vector<int64_t> seqs;        // S values, each a row per layout
  int64_t batch = 1;                // B
  // Sequences per micro-batch on a pipeline (pp > 1): the step runs B / micro_batch of them
  // through the layout's schedule, as `train --micro-batch` does. 0: one sequence each (m = B).
  // Layouts without pp run the whole batch at once.
  int64_t micro_batch = 0;
  int reps = 3;                     // interleaved repetitions (medians reported)
  bool memory_only = false;         // one step per layout (oversubscribed runs: time means little)
  bool forward_only = false;        // time forward steps (with the loss) instead of training steps
  int warmup = 1;                   // untimed steps of each model before its timed one (0: a cold step)
  bool profile = false;             // time each backend op (rank 0) beside the plan's price of it
  const Hardware* hardware = nullptr;  // for the predicted step time; none: not predicted
};

// One backend op of a row's profile: rank 0's timed step against the plan's timeline of rank 0
// (plan/timeline.h: the op's compute intervals, stalls not included).
struct OpProfileRow {
  std::string op;  // backend op name, e.g. "matmul", "attention_backward"
  double measured_s = 0, predicted_s = 0;
  int64_t measured_calls = 0, predicted_calls = 0;
};

struct LayoutBenchRow {
  std::string layout;
  int64_t seq = 0, batch = 0;
  // measured
  double step_s = 0, tokens_per_s = 0, exposed_s = 0;
  // Each repetition's step (slowest rank), in the order they ran, interleaved with the other
  // layouts' (layout_ranking pairs repetition i of one layout with repetition i of another).
  std::vector<double> step_samples_s;
  int64_t peak_bytes = 0;      // tracked peak, worst rank
  uint64_t bytes_sent = 0;     // summed over the model axes, worst rank
  // predicted (src/plan) for rank 0
  int64_t predicted_peak_bytes = 0;
  uint64_t predicted_bytes_sent = 0;
  double predicted_step_s = 0, predicted_tokens_per_s = 0;  // 0 without hardware
  double predicted_exposed_s = 0;                           // the timeline's stalls, rank 0
  std::vector<OpProfileRow> profile;  // with LayoutBenchOptions::profile: by measured time, largest first
  // With profile: per "axis operation" (e.g. "tsp all_gather"; the _v forms under their
  // equal-count names, as the plan has them), rank 0's seconds blocked in it against the
  // timeline's stalls on it, and its calls against the timeline's transfers. Largest first.
  std::vector<OpProfileRow> waits;
  // With profile: rank 0's page faults during the timed step (getrusage's minor faults: a warm
  // step that faults is touching fresh memory, docs/PERFORMANCE.md "Fresh pages"; major
  // faults: pages read back from disk, e.g. code the kernel dropped). Medians.
  int64_t page_faults = 0, major_page_faults = 0;
  // MoE models: the tokens each expert received in the timed step (all sparse layers), and
  // the routing the prediction assumed from it (plan --moe-imbalance X: moe_imbalance_of_load).
  std::vector<int64_t> expert_load;
  double moe_imbalance = 1.0;
};

// invalid_argument for a layout that does not use every rank or does not divide the sizes.
Result<std::vector<LayoutBenchRow>> run_layout_bench(const LayoutBenchOptions& options, Communicator& world);

// The rows as a fixed-width table.
std::string layout_bench_text(const std::vector<LayoutBenchRow>& rows);

// The ranking of one S's layouts, measured against predicted. The measured order alone says
// little where layouts lie within the machine's run-to-run spread (here 2-5% between rounds),
// so a pair counts as decided only by a sign test over the interleaved repetitions: one
// layout's step is shorter in every repetition, and there are at least
// kRankingMinRepetitions of them (two-sided, chance 2 / 2^5 = 6% at 5, 1.6% at 7). The plan
// ranks a decided pair right when its predicted steps order the two the same way.
struct LayoutRanking {
  int64_t seq = 0;
  int repetitions = 0;  // the fewest any layout at this S had
  std::vector<std::string> measured;  // fastest first, by median step
  std::vector<std::string> planned;   // fastest first, by predicted step (empty: no prediction)
  int pairs = 0, decided = 0, plan_agrees = 0;
  std::vector<std::string> plan_against;  // each decided pair the plan orders the other way
};
inline constexpr int kRankingMinRepetitions = 5;
// One entry per S with at least two layouts, in the rows' order of S.
std::vector<LayoutRanking> layout_ranking(const std::vector<LayoutBenchRow>& rows);
// "ranking S=...: ..." lines, one or two per S (layout_bench_text appends them).
std::string layout_ranking_text(const std::vector<LayoutRanking>& rankings);
// The rows' profiles (empty without LayoutBenchOptions::profile): per op, measured and
// predicted seconds and calls of the median step; then per communication operation the
// seconds rank 0 was blocked in it against the plan's simulated stalls.
std::string layout_bench_profile_text(const std::vector<LayoutBenchRow>& rows);
// Writes table.csv, table.json and, with gnuplot, memory.png (peak per rank against S),
// throughput.png (tokens/s against S) and predicted.png (predicted against measured peak
// and step time) into out_dir. Returns the paths written; not_found when gnuplot is missing
// (the tables are written first).
Result<std::vector<std::string>> write_layout_bench(const std::vector<LayoutBenchRow>& rows, const std::string& out_dir);

}  // namespace foldpar
