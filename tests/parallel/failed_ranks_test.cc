// failed_ranks (parallel/failed_ranks.h): every rank learns the same list of the ranks that
// failed a phase, whichever failed (none, one, every other, all). Under mpirun at 1 to 4 ranks.
#include <gtest/gtest.h>

#include "mpi_test_main.h"
#include "parallel/failed_ranks.h"

namespace foldpar {
namespace {

TEST(FailedRanks, EveryRankLearnsTheSameListOfTheRanksThatFailed) {
  Communicator& world = test::mpi().world();
  const int W = world.size(), r = world.rank();
  EXPECT_TRUE(failed_ranks(world, false).empty());
  std::vector<int> all(static_cast<size_t>(W));
  for (int i = 0; i < W; ++i) all[static_cast<size_t>(i)] = i;
  EXPECT_EQ(failed_ranks(world, true), all);
  EXPECT_EQ(failed_ranks(world, r == W - 1), std::vector<int>{W - 1});
  std::vector<int> odd;
  for (int i = 1; i < W; i += 2) odd.push_back(i);
  EXPECT_EQ(failed_ranks(world, r % 2 == 1), odd);
}

}  // namespace
}  // namespace foldpar
