// Reading CommOptions from the environment.
#include "comm/comm_options.h"

#include <cmath>
#include <cstdlib>
#include <string>

namespace foldpar {

Result<CommOptions> CommOptions::from_env() {
  CommOptions options;
  if (const char* check = std::getenv("FOLDPAR_COMM_CHECK"); check != nullptr) {
    const std::string value = check;
    if (value == "1") {
      options.check = true;
    } else if (value == "0" || value.empty()) {
      options.check = false;
    } else {
      return invalid_argument("FOLDPAR_COMM_CHECK='{}' must be 0 or 1", value);
    }
  }
  if (const char* timeout = std::getenv("FOLDPAR_COMM_TIMEOUT"); timeout != nullptr) {
    char* end = nullptr;
    const double seconds = std::strtod(timeout, &end);
    if (end == timeout || *end != '\0' || !std::isfinite(seconds) || seconds < 0) {
      return invalid_argument("FOLDPAR_COMM_TIMEOUT='{}' must be a number of seconds >= 0 (0 disables the watchdog)",
                              timeout);
    }
    options.timeout_s = seconds;
  }
  if (const char* rs = std::getenv("FOLDPAR_REDUCE_SCATTER"); rs != nullptr) {
    const std::string value = rs;
    if (value == "pairwise" || value.empty()) {
      options.reduce_scatter = CommOptions::ReduceScatterAlgorithm::kPairwise;
    } else if (value == "library") {
      options.reduce_scatter = CommOptions::ReduceScatterAlgorithm::kLibrary;
    } else {
      return invalid_argument("FOLDPAR_REDUCE_SCATTER='{}' must be pairwise or library", value);
    }
  }
  return options;
}

}  // namespace foldpar
