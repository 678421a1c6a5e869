// StepTimer: checked waits and blocking calls, their time added up.
#include "parallel/step_timer.h"

#include "core/check.h"

namespace foldpar {

void StepTimer::blocking(const Status& status, Clock::time_point started) {
  FP_CHECK_OK(status);
  seconds_ += std::chrono::duration<double>(Clock::now() - started).count();
}

void StepTimer::wait(CommRequest& request) {
  if (!request.pending()) return;
  const Clock::time_point started = Clock::now();
  blocking(request.wait(), started);
}

void StepTimer::wait_all(std::vector<CommRequest>& requests) {
  for (CommRequest& r : requests) wait(r);
  requests.clear();
}

void StepTimer::poke(CommRequest& request) {
  if (!request.pending()) return;
  bool done = false;
  FP_CHECK_OK(request.test(&done));
}

void StepTimer::poke(std::vector<CommRequest>& requests) {
  for (CommRequest& r : requests) poke(r);
}

}  // namespace foldpar
