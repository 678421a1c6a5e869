// failed_ranks: one all_gather of every rank's flag.
#include "parallel/failed_ranks.h"

#include "core/check.h"

namespace foldpar {

std::vector<int> failed_ranks(Communicator& comm, bool failed) {
  const int32_t mine = failed ? 1 : 0;
  std::vector<int32_t> all(static_cast<size_t>(comm.size()));
  FP_CHECK_OK(comm.all_gather(&mine, all.data(), 1, DType::kI32));
  std::vector<int> ranks;
  for (int r = 0; r < comm.size(); ++r)
    if (all[static_cast<size_t>(r)] != 0) ranks.push_back(r);
  return ranks;
}

}  // namespace foldpar
