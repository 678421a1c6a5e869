// `foldpar plot METRICS.jsonl -o DIR`: loss, throughput and memory of a training run as PNG
// files drawn by gnuplot (loss.png, throughput.png, memory.png).
#pragma once

#include <string>
#include <vector>

#include "core/status.h"

namespace foldpar {

// Returns the PNG paths written. not_found when gnuplot is not installed.
Result<std::vector<std::string>> plot_metrics(const std::string& metrics_path, const std::string& out_dir);

}  // namespace foldpar
