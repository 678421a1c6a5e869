// main() of the GoogleTest programs in tests/parallel: one MpiRuntime per process; rank 0
// prints the usual report, other ranks print only their failures (prefixed with the rank);
// after each test rank 0 also names the other ranks it failed on (its own "OK" speaks only
// for rank 0); every rank exits 1 if any rank failed, so mpirun and ctest see the failure.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "mpi_test_main.h"

namespace foldpar::test {
namespace {

MpiRuntime* g_runtime = nullptr;

// Failures of a rank other than 0, one line each.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  // The test's name is taken here: OnTestPartResult runs under GoogleTest's lock, where
  // asking UnitTest for the current test would deadlock.
  void OnTestStart(const ::testing::TestInfo& test) override {
    test_ = std::string(test.test_suite_name()) + "." + test.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s at %s:%d: failure\n%s\n", rank_, test_.c_str(),
                 result.file_name() ? result.file_name() : "?", result.line_number(), result.message());
  }

 private:
  int rank_;
  std::string test_;
};

// On every rank, after each test: which ranks failed it. Rank 0 prints them under its own
// result line, so a test that passed on rank 0 and failed elsewhere does not read as a pass.
// Every rank runs the same tests in the same order, so the all-gather pairs up.
class RankOutcomeGatherer : public ::testing::EmptyTestEventListener {
 public:
  explicit RankOutcomeGatherer(Communicator& world) : world_(world) {}
  void OnTestEnd(const ::testing::TestInfo& test) override {
    const int failed = test.result()->Failed() ? 1 : 0;
    std::vector<int> all(static_cast<size_t>(world_.size()));
    FP_CHECK_OK(world_.all_gather(&failed, all.data(), 1, DType::kI32));
    if (world_.rank() != 0) return;
    std::string others;
    for (size_t r = 1; r < all.size(); ++r)
      if (all[r] != 0) others += (others.empty() ? "" : ", ") + std::to_string(r);
    if (!others.empty())
      std::fprintf(stderr, "[  FAILED  ] %s.%s on rank(s) %s (see their [rank R] lines)\n", test.test_suite_name(),
                   test.name(), others.c_str());
  }

 private:
  Communicator& world_;
};

}  // namespace

MpiRuntime& mpi() {
  FP_CHECK(g_runtime != nullptr, "the MPI test runtime is not set up");
  return *g_runtime;
}

}  // namespace foldpar::test

int main(int argc, char** argv) {
  using foldpar::CommOptions, foldpar::MpiRuntime, foldpar::Result, foldpar::DType, foldpar::ReduceOp;
  Result<CommOptions> options = CommOptions::from_env();
  if (!options.ok()) {
    std::fprintf(stderr, "%s\n", options.status().to_string().c_str());
    return 2;
  }
  auto runtime = std::make_unique<MpiRuntime>(&argc, &argv, options.value());
  foldpar::test::g_runtime = runtime.get();
  ::testing::InitGoogleTest(&argc, argv);
  if (runtime->world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new foldpar::test::RankFailurePrinter(runtime->world_rank()));
  }
  ::testing::UnitTest::GetInstance()->listeners().Append(new foldpar::test::RankOutcomeGatherer(runtime->world()));
  const int local_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  FP_CHECK_OK(runtime->world().all_reduce(&local_failed, &any_failed, 1, DType::kI32, ReduceOp::kMax));
  if (runtime->world_rank() == 0 && any_failed && !local_failed) {
    std::fprintf(stderr, "a rank other than 0 failed (see [rank R] lines)\n");
  }
  foldpar::test::g_runtime = nullptr;
  runtime.reset();
  return any_failed;
}
