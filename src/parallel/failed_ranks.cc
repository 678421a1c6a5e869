// agree_on_phase: one all_gather of every rank's status code.
#include "parallel/failed_ranks.h"

#include "core/check.h"

namespace foldpar {

PhaseVerdict agree_on_phase(Communicator& comm, const Status& mine) {
  const int32_t code = static_cast<int32_t>(mine.code());
  std::vector<int32_t> all(static_cast<size_t>(comm.size()));
  FP_CHECK_OK(comm.all_gather(&code, all.data(), 1, DType::kI32));
  PhaseVerdict v;
  for (int r = 0; r < comm.size(); ++r)
    if (all[static_cast<size_t>(r)] != static_cast<int32_t>(StatusCode::kOk)) v.failed.push_back(r);
  if (!v.failed.empty()) v.first_code = static_cast<StatusCode>(all[static_cast<size_t>(v.failed.front())]);
  return v;
}

std::vector<int> failed_ranks(Communicator& comm, bool failed) {
  return agree_on_phase(comm, failed ? Status(StatusCode::kInternal, "failed") : Status()).failed;
}

}  // namespace foldpar
