// Timing for benchmarks and the calibration: one clock reading, one quantile (and median),
// one "median seconds of a repeated call". bench/ and app/ share this one implementation,
// so every figure foldpar prints is a median taken the same way. Not for tests: timings are
// reported, never asserted.
#pragma once

#include <functional>
#include <vector>

namespace foldpar {

enum class Clock {
  kWall,       // std::chrono::steady_clock: the elapsed time a user waits
  kThreadCpu,  // CPU time of the calling thread: on a shared machine it leaves out the
               // slices other processes held the core (single-threaded work only)
};

// Seconds on `clock` since a fixed but arbitrary origin; only differences mean anything.
double now_seconds(Clock clock = Clock::kWall);

// Seconds of one call of fn on `clock`.
double seconds_of(const std::function<void()>& fn, Clock clock = Clock::kWall);

// Quantile q in [0, 1] of the values, interpolated linearly between neighbours of the sorted
// values (q = 0.25 and 0.75 give the interquartile range). v must not be empty (FP_CHECK).
double quantile(std::vector<double> v, double q);
// quantile(v, 0.5): the middle value, or the mean of the two middle values of an even count.
double median(std::vector<double> v);

struct RepeatOptions {
  int reps = 5;               // timed calls, >= 1
  Clock clock = Clock::kWall;
  double budget_seconds = 0;  // > 0: fewer timed calls when the warm-up call shows that `reps`
                              // calls would take longer, but never fewer than min_reps
  int min_reps = 3;           // only with a budget
};

// Median seconds of one call of fn over the timed calls, after one warm-up call (timed only
// to size the budget).
double median_seconds(const RepeatOptions& options, const std::function<void()>& fn);

}  // namespace foldpar
