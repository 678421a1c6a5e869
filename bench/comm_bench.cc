// comm_bench: time of every collective through the communication layer beside the same raw
// MPI call on the same communicator, in the same run, interleaved repetition by repetition,
// for message sizes from 8 B to 64 MiB (256 MiB with --max-bytes). Reports algorithm and bus bandwidth in the
// nccl-tests convention (docs/PERFORMANCE.md, section "Communication"):
//   size    bytes of the largest buffer: all_reduce, broadcast, reduce n*beta; all_gather the
//           gathered result; reduce_scatter and all_to_all the send buffer; send_recv the
//           bytes each rank sends
//   algbw   size / time;  busbw = algbw * factor, factor 2(N-1)/N for all_reduce, (N-1)/N
//           for all_gather, reduce_scatter and all_to_all, 1 for broadcast, reduce, send_recv
//   time    the slowest rank's mean time per call in one sample; the table shows the median
//           over samples. Layer and raw samples alternate; "overhead" is the median over
//           those pairs of layer/raw - 1, "raw spread" the raw samples' IQR / median.
// Usage: mpirun -np N comm_bench [--reps R] [--min-bytes B] [--max-bytes B] [--sample-ms T]
//        [--ops all_reduce,all_gather,...] [--nonblocking] [--overlap] [--raw-vs-raw]
// --raw-vs-raw puts raw MPI in the layer's column too: the overhead column then shows how
// far apart two identical paths measure on this machine (the noise floor).
// --overlap instead measures how much of a non-blocking all_reduce hides behind computation
// when the computation never calls into MPI, and when it calls test() between 32 slices.
// The layer runs with the options of the environment (FOLDPAR_COMM_CHECK,
// FOLDPAR_COMM_TIMEOUT), so the same binary measures checking mode and the watchdog.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_cli.h"
#include "comm/mpi_runtime.h"
#include "core/check.h"
#include "core/timing.h"

namespace foldpar {
namespace {

struct BenchOptions {
  int reps = 9;                          // samples per variant; the median is reported
  size_t min_bytes = 8;
  size_t max_bytes = size_t{64} << 20;
  double sample_ms = 40;                 // target duration of one sample
  bool nonblocking = false;              // time i-forms + wait instead of blocking calls
  bool overlap = false;                  // run the overlap experiment instead of the table
  bool raw_vs_raw = false;               // time raw MPI in both columns: the noise floor
  std::vector<std::string> ops = {"all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                  "reduce",     "all_to_all", "send_recv"};
};

void add_flags(CLI::App& app, BenchOptions& o) {
  app.add_option("--reps", o.reps, "samples per variant (medians)")->check(bench::kPositive);
  app.add_option("--min-bytes", o.min_bytes, "smallest message size")->check(bench::kPositive);
  app.add_option("--max-bytes", o.max_bytes, "largest message size")->check(bench::kPositive);
  app.add_option("--sample-ms", o.sample_ms, "target duration of one sample")->check(bench::kPositive);
  app.add_option("--ops", o.ops, "collectives, comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
                             "send_recv"}));
  app.add_flag("--nonblocking", o.nonblocking, "time the i-forms + wait instead of the blocking calls");
  app.add_flag("--overlap", o.overlap, "measure how much of an iall_reduce hides behind computation");
  app.add_flag("--raw-vs-raw", o.raw_vs_raw, "raw MPI in both columns: the noise floor");
}

// One operation at one size: the layer's call and the raw MPI call on the same buffers.
struct Case {
  std::string op;
  size_t count = 0;    // elements passed to the call
  size_t bytes = 0;    // the nccl-tests "size"
  double bus_factor = 1;
  std::function<void()> layer;
  std::function<void()> raw;
};

#define BENCH_MPI(call) FP_CHECK((call) == MPI_SUCCESS, "{}", #call)

void wait_raw(MPI_Request* r, int n = 1) { BENCH_MPI(MPI_Waitall(n, r, MPI_STATUSES_IGNORE)); }

// Buffers sized for the largest case, shared by every case.
struct Buffers {
  std::vector<float> a, b;
};

Case make_case(const std::string& op, size_t size_bytes, Communicator& comm, Buffers& buf, bool nb) {
  const int N = comm.size(), p = comm.rank();
  const double n1 = N - 1.0;
  Case c;
  c.op = op;
  float* a = buf.a.data();
  float* b = buf.b.data();
  const MPI_Comm w = MPI_COMM_WORLD;  // the layer's world communicator wraps it
  const auto per_rank = [&](size_t bytes) { return std::max<size_t>(1, bytes / (4 * N)); };
  const auto run = [nb](const std::function<Status()>& blocking, const std::function<CommRequest()>& start) {
    return [=] { FP_CHECK_OK(nb ? start().wait() : blocking()); };
  };
  if (op == "all_reduce") {
    const size_t n = std::max<size_t>(1, size_bytes / 4);
    c = {op, n, n * 4, 2 * n1 / N, nullptr, nullptr};
    c.layer = run([=, &comm] { return comm.all_reduce(a, b, n, DType::kF32, ReduceOp::kSum); },
                  [=, &comm] { return comm.iall_reduce(a, b, n, DType::kF32, ReduceOp::kSum); });
    c.raw = [=] {
      if (!nb) {
        BENCH_MPI(MPI_Allreduce(a, b, static_cast<int>(n), MPI_FLOAT, MPI_SUM, w));
        return;
      }
      MPI_Request r;
      BENCH_MPI(MPI_Iallreduce(a, b, static_cast<int>(n), MPI_FLOAT, MPI_SUM, w, &r));
      wait_raw(&r);
    };
  } else if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") {
    const size_t n = per_rank(size_bytes);
    c = {op, n, n * 4 * N, n1 / N, nullptr, nullptr};
    const int k = static_cast<int>(n);
    if (op == "all_gather") {
      c.layer = run([=, &comm] { return comm.all_gather(a, b, n, DType::kF32); },
                    [=, &comm] { return comm.iall_gather(a, b, n, DType::kF32); });
      c.raw = [=] {
        if (!nb) {
        BENCH_MPI(MPI_Allgather(a, k, MPI_FLOAT, b, k, MPI_FLOAT, w));
        return;
      }
        MPI_Request r;
        BENCH_MPI(MPI_Iallgather(a, k, MPI_FLOAT, b, k, MPI_FLOAT, w, &r));
        wait_raw(&r);
      };
    } else if (op == "reduce_scatter") {
      c.layer = run([=, &comm] { return comm.reduce_scatter(a, b, n, DType::kF32, ReduceOp::kSum); },
                    [=, &comm] { return comm.ireduce_scatter(a, b, n, DType::kF32, ReduceOp::kSum); });
      c.raw = [=] {
        if (!nb) {
        BENCH_MPI(MPI_Reduce_scatter_block(a, b, k, MPI_FLOAT, MPI_SUM, w));
        return;
      }
        MPI_Request r;
        BENCH_MPI(MPI_Ireduce_scatter_block(a, b, k, MPI_FLOAT, MPI_SUM, w, &r));
        wait_raw(&r);
      };
    } else {
      c.layer = run([=, &comm] { return comm.all_to_all(a, b, n, DType::kF32); },
                    [=, &comm] { return comm.iall_to_all(a, b, n, DType::kF32); });
      c.raw = [=] {
        if (!nb) {
        BENCH_MPI(MPI_Alltoall(a, k, MPI_FLOAT, b, k, MPI_FLOAT, w));
        return;
      }
        MPI_Request r;
        BENCH_MPI(MPI_Ialltoall(a, k, MPI_FLOAT, b, k, MPI_FLOAT, w, &r));
        wait_raw(&r);
      };
    }
  } else if (op == "broadcast" || op == "reduce") {
    const size_t n = std::max<size_t>(1, size_bytes / 4);
    const int k = static_cast<int>(n);
    c = {op, n, n * 4, 1, nullptr, nullptr};
    if (op == "broadcast") {
      c.layer = run([=, &comm] { return comm.broadcast(a, n, DType::kF32, 0); },
                    [=, &comm] { return comm.ibroadcast(a, n, DType::kF32, 0); });
      c.raw = [=] {
        if (!nb) {
        BENCH_MPI(MPI_Bcast(a, k, MPI_FLOAT, 0, w));
        return;
      }
        MPI_Request r;
        BENCH_MPI(MPI_Ibcast(a, k, MPI_FLOAT, 0, w, &r));
        wait_raw(&r);
      };
    } else {
      c.layer = run([=, &comm] { return comm.reduce(a, b, n, DType::kF32, ReduceOp::kSum, 0); },
                    [=, &comm] { return comm.ireduce(a, b, n, DType::kF32, ReduceOp::kSum, 0); });
      c.raw = [=] {
        if (!nb) {
        BENCH_MPI(MPI_Reduce(a, b, k, MPI_FLOAT, MPI_SUM, 0, w));
        return;
      }
        MPI_Request r;
        BENCH_MPI(MPI_Ireduce(a, b, k, MPI_FLOAT, MPI_SUM, 0, w, &r));
        wait_raw(&r);
      };
    }
  } else if (op == "send_recv") {  // one forward ring step
    const size_t n = std::max<size_t>(1, size_bytes / 4);
    const int k = static_cast<int>(n), next = (p + 1) % N, prev = (p + N - 1) % N;
    c = {op, n, n * 4, 1, nullptr, nullptr};
    c.layer = run([=, &comm] { return comm.send_recv(a, b, n, DType::kF32, next, prev); },
                  [=, &comm] { return comm.isend_recv(a, b, n, DType::kF32, next, prev); });
    c.raw = [=] {
      if (!nb) {
        BENCH_MPI(MPI_Sendrecv(a, k, MPI_FLOAT, next, 0, b, k, MPI_FLOAT, prev, 0, w, MPI_STATUS_IGNORE));
        return;
      }
      MPI_Request r[2];
      BENCH_MPI(MPI_Irecv(b, k, MPI_FLOAT, prev, 0, w, &r[1]));
      BENCH_MPI(MPI_Isend(a, k, MPI_FLOAT, next, 0, w, &r[0]));
      wait_raw(r, 2);
    };
  } else {
    FP_CHECK(false, "unknown op {}", op);
  }
  return c;
}

// Mean seconds per call of `fn` over `iters` calls, the slowest rank's.
double time_sample(const std::function<void()>& fn, int iters) {
  BENCH_MPI(MPI_Barrier(MPI_COMM_WORLD));
  const double t0 = now_seconds();
  for (int i = 0; i < iters; ++i) fn();
  double t = (now_seconds() - t0) / iters, slowest = 0;
  BENCH_MPI(MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  return slowest;
}

struct Row {
  double layer_s, raw_s;  // medians over samples
  double overhead;        // median over sample pairs of layer / raw - 1
  double raw_spread;      // interquartile range / median of the raw samples
};

Row measure(const Case& c, const BenchOptions& o) {
  for (int i = 0; i < 2; ++i) {  // warm up both paths (connections, algorithm selection)
    c.layer();
    c.raw();
  }
  // Calls per sample: aim at sample_ms from the median of three single calls (the same on
  // every rank, since time_sample returns the slowest rank's time).
  const double once = median({time_sample(c.raw, 1), time_sample(c.raw, 1), time_sample(c.raw, 1)});
  const int iters = static_cast<int>(std::clamp(o.sample_ms * 1e-3 / std::max(once, 1e-9), 1.0, 5000.0));
  std::vector<double> layer, raw, ratio;
  for (int r = 0; r < o.reps; ++r) {  // interleaved, alternating which goes first
    if (r % 2 == 0) {
      layer.push_back(time_sample(c.layer, iters));
      raw.push_back(time_sample(c.raw, iters));
    } else {
      raw.push_back(time_sample(c.raw, iters));
      layer.push_back(time_sample(c.layer, iters));
    }
    ratio.push_back(layer.back() / raw.back());
  }
  const double raw_median = median(raw);
  return {median(layer), raw_median, median(ratio) - 1, (quantile(raw, 0.75) - quantile(raw, 0.25)) / raw_median};
}

std::string size_name(size_t bytes) {
  if (bytes >= (size_t{1} << 20) && bytes % (size_t{1} << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= 1024 && bytes % 1024 == 0) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

// 8 B to 1 MiB in steps of 8, then 4 MiB steps to 64 MiB.
constexpr size_t kSizes[] = {8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20};

void run(MpiRuntime& mpi, const BenchOptions& o) {
  Communicator& world = mpi.world();
  const int N = world.size();
  Buffers buf;
  const size_t elems = o.max_bytes / 4 * 2 + 16;
  buf.a.assign(elems, 1.0f);
  buf.b.assign(elems, 0.0f);
  if (world.rank() == 0) {
    std::printf("comm_bench: %d ranks on %s, f32, %s%s, watchdog %s, checking mode %s, %d samples per variant\n\n", N,
                mpi.host().c_str(), o.nonblocking ? "non-blocking (i-form + wait)" : "blocking",
                o.raw_vs_raw ? ", RAW MPI IN BOTH COLUMNS" : "",
                mpi.watchdog_enabled() ? fmt::format("{} s", mpi.options().timeout_s).c_str() : "off",
                mpi.options().check ? "on" : "off", o.reps);
    std::printf("| op | size | layer time (us) | layer algbw (GB/s) | layer busbw (GB/s) | raw MPI time (us) | "
                "raw busbw (GB/s) | layer overhead | raw spread |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  for (const std::string& op : o.ops) {
    for (size_t size : kSizes) {
      if (size < o.min_bytes || size > o.max_bytes) continue;
      Case c = make_case(op, size, world, buf, o.nonblocking);
      if (o.raw_vs_raw) c.layer = c.raw;
      const Row row = measure(c, o);
      if (world.rank() != 0) continue;
      const double alg = c.bytes / row.layer_s / 1e9, raw_alg = c.bytes / row.raw_s / 1e9;
      std::printf("| %s | %s | %.2f | %.3f | %.3f | %.2f | %.3f | %+.1f%% | %.0f%% |\n", op.c_str(),
                  size_name(c.bytes).c_str(), row.layer_s * 1e6, alg, alg * c.bus_factor, row.raw_s * 1e6,
                  raw_alg * c.bus_factor, 100 * row.overhead, 100 * row.raw_spread);
      std::fflush(stdout);
    }
  }
}

// Computation that touches no MPI: about `seconds` of arithmetic in `slices` pieces, with
// `between()` run after each piece.
double compute(double seconds, int slices, const std::function<void()>& between) {
  volatile double acc = 0;
  const double t_end = now_seconds() + seconds;
  for (int s = 0; s < slices; ++s) {
    const double slice_end = now_seconds() + (t_end - now_seconds()) / (slices - s);
    while (now_seconds() < slice_end) {
      for (int i = 0; i < 1000; ++i) acc = acc + 1e-9 * i;
    }
    between();
  }
  return acc;
}

void run_overlap(MpiRuntime& mpi, const BenchOptions& o) {
  Communicator& world = mpi.world();
  if (world.rank() == 0) {
    std::printf("comm_bench --overlap: %d ranks on %s, iall_reduce f32 beside computation of equal length\n\n"
                "| size | transfer alone = computation (ms) | no MPI calls while computing (ms) | "
                "test() between 32 slices (ms) | hidden without / with test() |\n|---:|---:|---:|---:|---:|\n",
                world.size(), mpi.host().c_str());
  }
  for (size_t bytes : {size_t{1} << 20, size_t{16} << 20, size_t{64} << 20}) {
    if (bytes > o.max_bytes) continue;
    const size_t n = bytes / 4;
    std::vector<float> a(n, 1.0f), b(n);
    const auto transfer = [&] { FP_CHECK_OK(world.all_reduce(a.data(), b.data(), n, DType::kF32, ReduceOp::kSum)); };
    transfer();
    std::vector<double> alone, quiet, polled;
    for (int r = 0; r < o.reps; ++r) alone.push_back(time_sample(transfer, 1));
    const double t_comm = median(alone);
    const auto overlapped = [&](bool poll) {
      return [&, poll] {
        CommRequest req = world.iall_reduce(a.data(), b.data(), n, DType::kF32, ReduceOp::kSum);
        compute(t_comm, 32, [&] {
          bool done = false;
          if (poll) FP_CHECK_OK(req.test(&done));
        });
        FP_CHECK_OK(req.wait());
      };
    };
    for (int r = 0; r < o.reps; ++r) {
      quiet.push_back(time_sample(overlapped(false), 1));
      polled.push_back(time_sample(overlapped(true), 1));
    }
    const double t_quiet = median(quiet), t_polled = median(polled);
    // Fraction of the transfer hidden: 1 when the total equals the computation alone.
    const auto hidden = [&](double t) { return std::clamp((2 * t_comm - t) / t_comm, 0.0, 1.0); };
    if (world.rank() == 0) {
      std::printf("| %s | %.2f | %.2f | %.2f | %.0f%% / %.0f%% |\n", size_name(bytes).c_str(), t_comm * 1e3,
                  t_quiet * 1e3, t_polled * 1e3, 100 * hidden(t_quiet), 100 * hidden(t_polled));
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace foldpar

int main(int argc, char** argv) {
  using foldpar::BenchOptions, foldpar::CommOptions, foldpar::Result;
  Result<CommOptions> comm_options = CommOptions::from_env();
  if (!comm_options.ok()) {
    std::fprintf(stderr, "comm_bench: %s\n", comm_options.status().to_string().c_str());
    return 2;
  }
  foldpar::MpiRuntime mpi(&argc, &argv, comm_options.value());
  BenchOptions options;
  CLI::App app{"Every collective through the communication layer beside raw MPI (run under mpirun)", "comm_bench"};
  foldpar::add_flags(app, options);
  if (std::optional<int> rc = foldpar::bench::parse_flags(app, argc, argv, mpi.world_rank() == 0)) return *rc;
  if (options.max_bytes < options.min_bytes) {
    if (mpi.world_rank() == 0)
      std::fprintf(stderr, "comm_bench: --min-bytes (%zu) must be <= --max-bytes (%zu)\n", options.min_bytes,
                   options.max_bytes);
    return 2;
  }
  if (options.overlap) {
    foldpar::run_overlap(mpi, options);
  } else {
    foldpar::run(mpi, options);
  }
  return 0;
}
