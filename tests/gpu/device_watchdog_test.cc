// The NCCL watchdog's logic (comm/nccl/device_watchdog.h) without a GPU: the completion
// queries, the asynchronous error and the communicator's abort are functions here, and time
// is passed in, so each verdict is checked exactly. The NCCL communicator supplies
// cudaEventQuery, ncclCommGetAsyncError and ncclCommAbort.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "comm/nccl/device_watchdog.h"

namespace foldpar::nccl_detail {
namespace {

using Clock = DeviceWatchdog::Clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

struct Recorder {
  std::string async;  // what the communicator reports, "" while healthy
  int aborts = 0;
  std::vector<std::string> reports;
  DeviceWatchdogHooks hooks() {
    return {[this] { return async; }, [this] { ++aborts; }, [this](const std::string& r) { reports.push_back(r); }};
  }
};

CommOp all_reduce(uint64_t seq) {
  CommOp op;
  op.kind = CommOpKind::kAllReduce;
  op.seq = seq;
  return op;
}

TEST(DeviceWatchdog, CompletedOperationsNeverExpire) {
  Recorder rec;
  DeviceWatchdog w("tsp", 1, 4, 10.0, rec.hooks(), false);
  const Clock::time_point t0 = Clock::now();
  bool done = false;
  w.begin(all_reduce(1), [&] { return done; }, t0);
  EXPECT_EQ(w.poll(t0 + seconds(9)), "");
  EXPECT_EQ(w.in_flight(), 1u);
  done = true;
  EXPECT_EQ(w.poll(t0 + seconds(60)), "");  // completed late, but before this poll: not a hang
  EXPECT_EQ(w.in_flight(), 0u);
  EXPECT_EQ(rec.aborts, 0);
  EXPECT_TRUE(rec.reports.empty());
}

TEST(DeviceWatchdog, TheOldestPendingOperationExpiresNamedWithItsPurpose) {
  Recorder rec;
  DeviceWatchdog w("tsp", 2, 4, 10.0, rec.hooks(), false);
  const Clock::time_point t0 = Clock::now();
  CommOp recv;
  recv.kind = CommOpKind::kRecv;
  recv.seq = 7;
  recv.source = 3;
  recv.purpose = {"pipeline: stage {0} never sent micro-batch {1}", {1, 2}};
  w.begin(recv, [] { return false; }, t0);
  w.begin(all_reduce(5), [] { return false; }, t0 + seconds(5));
  EXPECT_EQ(w.poll(t0 + seconds(10)), "");  // at the timeout, not past it
  const std::string report = w.poll(t0 + milliseconds(10500));
  EXPECT_NE(report.find("pipeline: stage 1 never sent micro-batch 2: recv #7 from rank 3 on communicator 'tsp' "
                        "(rank 2 of 4), enqueued 10.5 s ago"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("10 s timeout (FOLDPAR_COMM_TIMEOUT)"), std::string::npos) << report;
  EXPECT_EQ(rec.aborts, 1);
  ASSERT_EQ(rec.reports.size(), 1u);
  EXPECT_EQ(rec.reports[0], report);
  // Once failed: the same report, no second abort or fail.
  EXPECT_EQ(w.poll(t0 + seconds(20)), report);
  EXPECT_EQ(rec.aborts, 1);
  EXPECT_EQ(rec.reports.size(), 1u);
  EXPECT_TRUE(w.failed());
}

TEST(DeviceWatchdog, AnAsynchronousErrorIsReportedAtOnce) {
  Recorder rec;
  DeviceWatchdog w("dp", 0, 2, 300.0, rec.hooks(), false);
  const Clock::time_point t0 = Clock::now();
  w.begin(all_reduce(3), [] { return false; }, t0);
  EXPECT_EQ(w.poll(t0 + seconds(1)), "");
  rec.async = "remote process exited or there was a network error (6)";
  const std::string report = w.poll(t0 + seconds(2));
  EXPECT_NE(report.find("communicator 'dp' (rank 0 of 2) failed: remote process exited or there was a network "
                        "error (6); pending: all_reduce #3"),
            std::string::npos)
      << report;
  EXPECT_EQ(rec.aborts, 1);
  EXPECT_EQ(rec.reports.size(), 1u);
}

TEST(DeviceWatchdog, TimeoutZeroLeavesOnlyAsynchronousErrors) {
  Recorder rec;
  DeviceWatchdog w("tsp", 0, 2, 0.0, rec.hooks(), false);
  const Clock::time_point t0 = Clock::now();
  w.begin(all_reduce(1), [] { return false; }, t0);
  EXPECT_EQ(w.poll(t0 + std::chrono::hours(1)), "");
  EXPECT_EQ(rec.aborts, 0);
}

// The background thread: a host wait on an operation that never completes ends with the
// report (the communicator's fail hook ends the process; here it records).
TEST(DeviceWatchdog, AHostWaitEndsWhenTheThreadReports) {
  std::atomic<int> aborts{0}, fails{0};
  DeviceWatchdog w("tsp", 0, 2, 0.2,
                   {[] { return std::string(); }, [&] { ++aborts; }, [&](const std::string&) { ++fails; }});
  std::atomic<bool> done{false};
  auto completed = [&] { return done.load(); };
  w.begin(all_reduce(1), completed);
  const Clock::time_point start = Clock::now();
  const Status s = w.wait_host(completed);
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("all_reduce #1 on communicator 'tsp'"), std::string::npos) << s.message();
  EXPECT_GE(waited, 0.2);
  EXPECT_LT(waited, 5.0);
  EXPECT_EQ(aborts.load(), 1);
  EXPECT_EQ(fails.load(), 1);
}

TEST(DeviceWatchdog, AHostWaitReturnsWhenTheOperationCompletes) {
  Recorder rec;
  DeviceWatchdog w("tsp", 0, 2, 30.0, rec.hooks());
  std::atomic<bool> done{false};
  auto completed = [&] { return done.load(); };
  w.begin(all_reduce(1), completed);
  std::thread finisher([&] {
    std::this_thread::sleep_for(milliseconds(30));
    done = true;
  });
  EXPECT_TRUE(w.wait_host(completed).ok());
  finisher.join();
  EXPECT_FALSE(w.failed());
}

}  // namespace
}  // namespace foldpar::nccl_detail
