// StepTimer: the seconds one step spends blocked in communication (waits on requests in
// flight and blocking collectives): the exposed communication, what overlap failed to hide.
// Every strategy's step and the ring attention count through one (StepResult's
// exposed_comm_seconds). A communication failure is a library failure: FP_CHECK_OK, as the
// communicator's contract says (comm/communicator.h). Not thread-safe; one per step.
#pragma once

#include <chrono>
#include <vector>

#include "comm/communicator.h"

namespace foldpar {

class StepTimer {
 public:
  using Clock = std::chrono::steady_clock;

  // A blocking call started at `started` returned `status`: checked, its time counted.
  void blocking(const Status& status, Clock::time_point started);
  // Waits for a request (nothing to do when none is pending), counting the time blocked.
  void wait(CommRequest& request);
  // Waits for every request, then clears the list.
  void wait_all(std::vector<CommRequest>& requests);
  // Advances transfers in flight (MPI moves them only inside MPI calls); never blocks.
  static void poke(CommRequest& request);
  static void poke(std::vector<CommRequest>& requests);

  double seconds() const { return seconds_; }

 private:
  double seconds_ = 0;
};

}  // namespace foldpar
