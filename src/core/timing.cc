// Benchmark timing (core/timing.h).
#include "core/timing.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "core/check.h"

namespace foldpar {

double now_seconds(Clock clock) {
  if (clock == Clock::kThreadCpu) {
    timespec ts{};
    FP_CHECK(clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double seconds_of(const std::function<void()>& fn, Clock clock) {
  const double t0 = now_seconds(clock);
  fn();
  return now_seconds(clock) - t0;
}

double quantile(std::vector<double> v, double q) {
  FP_CHECK(!v.empty(), "quantile of no values");
  FP_CHECK(q >= 0 && q <= 1, "quantile {} outside [0, 1]", q);
  std::sort(v.begin(), v.end());
  const double x = q * static_cast<double>(v.size() - 1);
  const size_t i = static_cast<size_t>(x);
  return i + 1 < v.size() ? v[i] + (x - static_cast<double>(i)) * (v[i + 1] - v[i]) : v[i];
}

double median(std::vector<double> v) { return quantile(std::move(v), 0.5); }

double median_seconds(const RepeatOptions& o, const std::function<void()>& fn) {
  FP_CHECK(o.reps >= 1, "median_seconds: reps ({}) must be positive", o.reps);
  const double first = seconds_of(fn, o.clock);
  int reps = o.reps;
  if (o.budget_seconds > 0)
    reps = std::max(o.min_reps, std::min(reps, static_cast<int>(o.budget_seconds / std::max(first, 1e-9))));
  std::vector<double> times;
  times.reserve(static_cast<size_t>(reps));
  for (int r = 0; r < reps; ++r) times.push_back(seconds_of(fn, o.clock));
  return median(std::move(times));
}

}  // namespace foldpar
