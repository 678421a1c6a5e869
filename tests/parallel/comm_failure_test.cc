// How a job ends when communication goes wrong. Each test launches comm_failure_job under
// mpirun (posix_spawn, own process group, output to a file, a hard time limit) and asserts:
//  - mpirun exits non-zero within the limit (watchdog timeout plus a margin);
//  - every rank started (one "started pid" line each) and none printed "exits normally", its
//    only path to exit status 0, so every rank ended with a failure or a signal;
//  - no process of the job remains afterwards (its pids and its marker argument are gone);
//  - the output names what went wrong: the disagreeing rank (checking mode), the operation,
//    sequence number, communicator and ranks not arrived (watchdog), rank and host (fatal).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace foldpar {
namespace {

using Clock = std::chrono::steady_clock;

struct JobResult {
  bool finished = false;  // ended before the limit
  int exit_code = -1;     // mpirun's exit status, or 128 + signal
  double seconds = 0;
  std::string output;
  std::vector<int> rank_pids;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Pids of live processes whose command line contains `marker`.
std::vector<int> processes_with(const std::string& marker) {
  std::vector<int> pids;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmdline = read_file(entry.path() / "cmdline");
    for (char& c : cmdline) c = c == '\0' ? ' ' : c;
    if (cmdline.find(marker) != std::string::npos) pids.push_back(std::stoi(name));
  }
  return pids;
}

// A zombie (Z) or a dead task (X) has released everything; anything else still runs.
bool alive(int pid) {
  const std::string status = read_file("/proc/" + std::to_string(pid) + "/status");
  return !status.empty() && status.find("State:\tZ") == std::string::npos &&
         status.find("State:\tX") == std::string::npos;
}

// Runs `mpirun -np ranks comm_failure_job scenario marker` with the given watchdog timeout
// and checking mode, killing the whole process group if it outlives limit_s.
JobResult run_job(const std::string& scenario, int ranks, double timeout_s, bool check, double limit_s,
                  const std::string& marker, const std::vector<std::string>& mpirun_flags) {
  setenv("FOLDPAR_COMM_TIMEOUT", std::to_string(timeout_s).c_str(), 1);
  setenv("FOLDPAR_COMM_CHECK", check ? "1" : "0", 1);
  setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
  const std::string out_path = ::testing::TempDir() + "comm_failure_" + marker + "_" + std::to_string(getpid()) + ".log";
  std::vector<std::string> args = {FOLDPAR_MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-np",
                                   std::to_string(ranks), "-x", "FOLDPAR_COMM_TIMEOUT", "-x", "FOLDPAR_COMM_CHECK"};
  args.insert(args.end(), mpirun_flags.begin(), mpirun_flags.end());
  args.insert(args.end(), {FOLDPAR_COMM_FAILURE_JOB, scenario, marker});
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  pid_t pid = 0;
  const Clock::time_point start = Clock::now();
  const int spawned = posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  JobResult result;
  if (spawned != 0) {
    result.output = "posix_spawn failed: " + std::string(strerror(spawned));
    return result;
  }
  int status = 0;
  while (true) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (done == pid) {
      result.finished = true;
      result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    if (result.seconds > limit_s) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  result.output = read_file(out_path);
  const std::regex started("rank \\d+ started pid (\\d+)");
  for (std::sregex_iterator it(result.output.begin(), result.output.end(), started), end; it != end; ++it) {
    result.rank_pids.push_back(std::stoi((*it)[1]));
  }
  return result;
}

// The assertions every scenario shares; returns the output for scenario-specific checks.
// recovery: mpirun runs with --enable-recovery, under which OpenMPI 4.1's mpirun exits 0
// even after MPI_Abort; the other signals still show that every rank failed.
std::string expect_whole_job_failed(const std::string& scenario, int ranks, double timeout_s, bool check,
                                    double margin_s, bool recovery = false) {
  const std::vector<std::string> mpirun_flags =
      recovery ? std::vector<std::string>{"--enable-recovery"} : std::vector<std::string>{};
  const std::string marker = "fp-comm-failure-" + scenario + "-" + std::to_string(getpid());
  const double limit_s = timeout_s + margin_s;
  const JobResult job = run_job(scenario, ranks, timeout_s, check, limit_s + 20, marker, mpirun_flags);
  const std::string& out = job.output;
  EXPECT_TRUE(job.finished) << scenario << ": mpirun still running after " << job.seconds << " s\n" << out;
  if (!recovery) EXPECT_NE(job.exit_code, 0) << scenario << "\n" << out;
  EXPECT_LT(job.seconds, limit_s) << scenario << ": took longer than the watchdog timeout plus " << margin_s << " s\n"
                                  << out;
  EXPECT_EQ(job.rank_pids.size(), static_cast<size_t>(ranks)) << scenario << ": not every rank started\n" << out;
  EXPECT_EQ(out.find("exits normally"), std::string::npos) << scenario << ": a rank finished normally\n" << out;
  // Nothing of the job may remain: neither a process with the marker in its command line
  // nor any rank's pid. An exiting process loses its command line before it is gone, so
  // both are polled for a few seconds before the verdict.
  const auto leftovers = [&] {
    std::vector<int> left = processes_with(marker);
    for (int pid : job.rank_pids) {
      if (alive(pid) && std::find(left.begin(), left.end(), pid) == left.end()) left.push_back(pid);
    }
    return left;
  };
  std::vector<int> left = leftovers();
  for (int i = 0; i < 100 && !left.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    left = leftovers();
  }
  EXPECT_TRUE(left.empty()) << scenario << ": " << left.size() << " processes of the job are left behind";
  for (int pid : left) kill(pid, SIGKILL);
  return out;
}

void expect_contains(const std::string& out, const std::string& text) {
  EXPECT_NE(out.find(text), std::string::npos) << "missing: " << text << "\n--- output ---\n" << out;
}

constexpr double kMargin = 15;  // mpirun start-up and teardown on a loaded 2-core machine

TEST(CommFailure, CheckingModeNamesTheRankThatSkippedACollective) {
  const std::string out = expect_whole_job_failed("skip", 3, 60, /*check=*/true, kMargin);
  expect_contains(out, "checking mode: ranks disagree at collective #2 on communicator world (world ranks 0-2)");
  expect_contains(out, "rank 1 calls all_gather #2 (count 10, F32)");
  expect_contains(out, "ranks 0,2 call all_reduce #2 (count 100, F32, sum)");
  expect_contains(out, "disagreeing: rank 1");
}

TEST(CommFailure, CheckingModeNamesARankWithAnotherCount) {
  const std::string out = expect_whole_job_failed("count", 3, 60, true, kMargin);
  expect_contains(out, "rank 2 calls all_gather #2 (count 5, F32); ranks 0,1 call all_gather #2 (count 4, F32)");
  expect_contains(out, "disagreeing: rank 2");
}

TEST(CommFailure, CheckingModeNamesARankWithAnotherRoot) {
  const std::string out = expect_whole_job_failed("root", 3, 60, true, kMargin);
  expect_contains(out, "rank 0 calls broadcast #2 (count 16, F32, root 1)");
  expect_contains(out, "disagreeing: rank 0");
}

TEST(CommFailure, WatchdogNamesTheRankThatNeverArrives) {
  const double timeout = 2;
  const std::string out = expect_whole_job_failed("hang", 3, timeout, false, kMargin);
  expect_contains(out, "watchdog: collective all_reduce #2 on communicator world (world ranks 0-2) has not "
                       "completed after");
  expect_contains(out, "ranks not arrived: 2;");
  expect_contains(out, "rank 2 (world 2 on ");
  expect_contains(out, "has entered 1 collectives on world, now not inside any communication");
}

TEST(CommFailure, WatchdogNamesThePeerOfAHungReceive) {
  const std::string out = expect_whole_job_failed("hang_p2p", 2, 2, false, kMargin);
  expect_contains(out, "watchdog: point-to-point recv #1 from rank 1 on communicator world (world ranks 0,1) has "
                       "not completed after");
  expect_contains(out, "rank 1 (world 1 on ");
  expect_contains(out, "now not inside any communication");
}

// The report of a collective held up by a sleeping rank also names the ranks outside the
// collective that wait in an operation with a purpose (rank 1 starts waiting a second after
// rank 0, so rank 0's watchdog reports first).
TEST(CommFailure, WatchdogReportsTheJobsWaitsThatHaveAPurpose) {
  const std::string out = expect_whole_job_failed("purpose_elsewhere", 3, 2, false, kMargin);
  expect_contains(out, "watchdog: collective all_reduce #1 on communicator pair (world ranks 0,2) has not completed");
  expect_contains(out, "ranks not arrived: 1; rank 1 (world 2 on ");
  expect_contains(out, "; elsewhere, world rank 1 on ");
  expect_contains(out, ": in recv #1 from rank 2 on world for ");
  expect_contains(out, "(test: rank 2 never sent token 17 (a purpose))");
}

// A pipeline rank that never arrives at a boundary: whichever rank's watchdog fires first
// (stage 1's TSP index 1 waits for the activation itself; the others wait in TSP collectives
// for ranks that are stalled or wait for it), its report names the stalled rank by stage,
// world rank, TSP index, micro-batch and direction: the waiting receive carries that purpose
// and every report lists the job's ranks that wait in an operation with a purpose.
TEST(CommFailure, WatchdogNamesThePipelineStageThatNeverSends) {
  const std::string out = expect_whole_job_failed("pp_stall", 4, 2, false, kMargin);
  expect_contains(out, "watchdog: ");
  expect_contains(out, "pipeline: stage 0 (world rank 1, tsp index 1) never sent the activation of micro-batch 2 "
                       "to stage 1");
}

// The same under generation (pp=2,tsp=2 decode in two groups): the boundary's purpose names
// the stalled rank and the group (the decode step's micro-batch).
TEST(CommFailure, WatchdogNamesThePipelineStageThatNeverSendsInDecode) {
  const std::string out = expect_whole_job_failed("pp_decode_stall", 4, 2, false, kMargin);
  expect_contains(out, "watchdog: ");
  expect_contains(out, "pipeline: stage 0 (world rank 1, tsp index 1) never sent the activation of micro-batch 1 "
                       "to stage 1");
}

// mpirun notices the death and kills the other ranks.
TEST(CommFailure, ARankKilledMidCollectiveEndsTheWholeJob) {
  expect_whole_job_failed("sigkill", 3, 5, false, kMargin);
}

// With --enable-recovery mpirun lets the job run on after the death (as some launchers
// do): the watchdog of the ranks left waiting must end it and name the dead rank.
TEST(CommFailure, WatchdogEndsTheJobWhenTheLauncherKeepsItRunningAfterADeath) {
  const std::string out = expect_whole_job_failed("sigkill", 3, 3, false, kMargin, /*recovery=*/true);
  expect_contains(out, "watchdog: collective all_reduce #2 on communicator world (world ranks 0-2)");
  expect_contains(out, "ranks not arrived: 1; rank 1 (world 1 on ");
  expect_contains(out, "no answer (dead, or its process is stopped)");
}

TEST(CommFailure, AFatalErrorOnOneRankEndsEveryRankWithRankAndHost) {
  const std::string out = expect_whole_job_failed("fatal", 3, 60, false, kMargin);
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  expect_contains(out, std::string("foldpar: fatal on rank 1 on ") + host);
  expect_contains(out, "deliberate failure of scenario fatal");
}

TEST(CommFailure, AnMpiErrorEndsEveryRankNamingTheCall) {
  const std::string out = expect_whole_job_failed("truncate", 2, 60, false, kMargin);
  expect_contains(out, "foldpar: fatal on rank 1 on ");
  expect_contains(out, "MPI_Recv(");
  expect_contains(out, "failed: MPI_ERR_TRUNCATE");
}

TEST(CommFailure, AShortMessageIsAFatalErrorNotSilentGarbage) {
  const std::string out = expect_whole_job_failed("short", 2, 60, false, kMargin);
  expect_contains(out, "recv #1 on communicator world (world ranks 0,1): expected 10 elements from rank 0, received 5");
}

}  // namespace
}  // namespace foldpar
