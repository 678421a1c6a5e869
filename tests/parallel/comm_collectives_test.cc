// Every collective, blocking and non-blocking (wait and test), in f32 and bf16, exact on
// integer-valued data, at every root, in and out of place, with zero counts and counts not
// divisible by the number of ranks; and after each call, the counters equal the formula of
// comm/comm_stats.h, written out again here by hand. Runs under mpirun at 1 to 4 ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "comm/communicator.h"
#include "comm_test_util.h"
#include "mpi_test_main.h"

namespace foldpar::test {
namespace {

constexpr size_t kCounts[] = {0, 1, 7, 1027};  // 7 and 1027 divide by none of 2, 3, 4

std::vector<double> expected(size_t n, const std::function<double(uint64_t)>& f) {
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = f(i);
  return out;
}

double sum_over_ranks(int n_ranks, uint64_t i) {
  double s = 0;
  for (int r = 0; r < n_ranks; ++r) s += value(r, i);
  return s;
}
double max_over_ranks(int n_ranks, uint64_t i) {
  double m = value(0, i);
  for (int r = 1; r < n_ranks; ++r) m = std::max(m, value(r, i));
  return m;
}

// Count patterns of the _v forms for N ranks: equal, zeros on odd ranks, all on the last
// rank, all zero.
std::vector<std::vector<size_t>> count_patterns(int n_ranks) {
  std::vector<std::vector<size_t>> out(4, std::vector<size_t>(n_ranks));
  for (int r = 0; r < n_ranks; ++r) {
    out[0][r] = 5;
    out[1][r] = r % 2 ? 0 : 3 + r;
    out[2][r] = r == n_ranks - 1 ? 11 : 0;
    out[3][r] = 0;
  }
  return out;
}

template <typename T>
class CollectivesTest : public ::testing::Test {
 protected:
  static constexpr DType kType = DTypeOf<T>::value;
  static constexpr size_t kBeta = sizeof(T);
  Communicator& comm() { return mpi().world(); }
};
using ElementTypes = ::testing::Types<float, bf16>;
TYPED_TEST_SUITE(CollectivesTest, ElementTypes);

TYPED_TEST(CollectivesTest, Broadcast) {
  using T = TypeParam;
  Communicator& comm = this->comm();
  const int p = comm.rank(), N = comm.size();
  for (size_t n : kCounts) {
    for (int root = 0; root < N; ++root) {
      for (Mode mode : kAllModes) {
        const std::string what = fmt::format("broadcast n={} root={} {}", n, root, mode_name(mode));
        std::vector<T> buf = filled<T>(n, [&](uint64_t i) { return p == root ? value(root, i) : 99; });
        ScopedCommCounter counter(comm);
        run_in_mode(
            mode, [&] { return comm.broadcast(buf.data(), n, this->kType, root); },
            [&] { return comm.ibroadcast(buf.data(), n, this->kType, root); });
        expect_values(buf, expected(n, [&](uint64_t i) { return value(root, i); }), what);
        // Chain root -> root+1 -> ... -> root-1: all but the root receive, all but the last send.
        expect_traffic(counter.delta(), CommOpKind::kBroadcast, p == (root + N - 1) % N ? 0 : n, p == root ? 0 : n,
                       this->kBeta, what);
      }
    }
  }
}

TYPED_TEST(CollectivesTest, Reduce) {
  using T = TypeParam;
  Communicator& comm = this->comm();
  const int p = comm.rank(), N = comm.size();
  // The last count is over 1 MiB: the MPI backend's non-blocking reduce then sends whole
  // buffers to the root (comm/mpi_communicator.cc, post_whole_buffers).
  std::vector<size_t> counts(std::begin(kCounts), std::end(kCounts));
  counts.push_back((size_t{1} << 20) / sizeof(T) + 7);
  for (size_t n : counts) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      for (int root = 0; root < N; ++root) {
        for (Mode mode : kAllModes) {
          for (bool in_place : {false, true}) {
            const std::string what = fmt::format("reduce n={} {} root={} {} in_place={}", n, reduce_op_name(op), root,
                                                 mode_name(mode), in_place);
            std::vector<T> send = filled<T>(n, [&](uint64_t i) { return value(p, i); });
            std::vector<T> recv = filled<T>(n, [](uint64_t) { return 99; });
            const T* src = in_place && p == root ? recv.data() : send.data();
            if (in_place && p == root) recv = send;
            T* dst = p == root ? recv.data() : nullptr;  // recv_buf is unused off the root
            ScopedCommCounter counter(comm);
            run_in_mode(
                mode, [&] { return comm.reduce(src, dst, n, this->kType, op, root); },
                [&] { return comm.ireduce(src, dst, n, this->kType, op, root); });
            if (p == root) {
              expect_values(recv, expected(n, [&](uint64_t i) {
                              return op == ReduceOp::kSum ? sum_over_ranks(N, i) : max_over_ranks(N, i);
                            }), what);
            }
            // The broadcast chain reversed: all but the root send, all but root-1 receive.
            expect_traffic(counter.delta(), CommOpKind::kReduce, p == root ? 0 : n,
                           p == (root + N - 1) % N ? 0 : n, this->kBeta, what);
          }
        }
      }
    }
  }
}

TYPED_TEST(CollectivesTest, AllReduce) {
  using T = TypeParam;
  Communicator& comm = this->comm();
  const int p = comm.rank(), N = comm.size();
  // The last count is over 1 MiB and divides by none of 2, 3, 4: the MPI backend's blocking
  // all-reduce then takes its pairwise path (comm/mpi_communicator.cc).
  std::vector<size_t> counts(std::begin(kCounts), std::end(kCounts));
  counts.push_back((size_t{1} << 20) / sizeof(T) + 7);
  for (size_t n : counts) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      for (Mode mode : kAllModes) {
        for (bool in_place : {false, true}) {
          const std::string what =
              fmt::format("all_reduce n={} {} {} in_place={}", n, reduce_op_name(op), mode_name(mode), in_place);
          std::vector<T> send = filled<T>(n, [&](uint64_t i) { return value(p, i); });
          std::vector<T> recv = in_place ? send : filled<T>(n, [](uint64_t) { return 99; });
          const T* src = in_place ? recv.data() : send.data();
          ScopedCommCounter counter(comm);
          run_in_mode(
              mode, [&] { return comm.all_reduce(src, recv.data(), n, this->kType, op); },
              [&] { return comm.iall_reduce(src, recv.data(), n, this->kType, op); });
          expect_values(recv, expected(n, [&](uint64_t i) {
                          return op == ReduceOp::kSum ? sum_over_ranks(N, i) : max_over_ranks(N, i);
                        }), what);
          // Ring reduce-scatter + ring all-gather over blocks b[i] = n/N, +1 for i < n mod N.
          std::vector<uint64_t> b(N, n / N);
          for (uint64_t i = 0; i < n % N; ++i) ++b[i];
          const uint64_t sent = (n - b[p]) + (n - b[(p + 1) % N]);
          const uint64_t received = (n - b[(p + N - 1) % N]) + (n - b[p]);
          expect_traffic(counter.delta(), CommOpKind::kAllReduce, sent, received, this->kBeta, what);
          if (n % N == 0) {
            EXPECT_EQ(counter.delta().total().bytes_sent, 2 * (N - 1) * n / N * this->kBeta) << what;
          }
        }
      }
    }
  }
}

TYPED_TEST(CollectivesTest, AllGather) {
  using T = TypeParam;
  Communicator& comm = this->comm();
  const int p = comm.rank(), N = comm.size();
  for (size_t c : kCounts) {
    for (Mode mode : kAllModes) {
      for (bool in_place : {false, true}) {
        const std::string what = fmt::format("all_gather count={} {} in_place={}", c, mode_name(mode), in_place);
        std::vector<T> send = filled<T>(c, [&](uint64_t i) { return value(p, i); });
        std::vector<T> recv = filled<T>(N * c, [](uint64_t) { return 99; });
        if (in_place) std::copy(send.begin(), send.end(), recv.begin() + p * c);
        const T* src = in_place ? recv.data() + p * c : send.data();
        ScopedCommCounter counter(comm);
        run_in_mode(
            mode, [&] { return comm.all_gather(src, recv.data(), c, this->kType); },
            [&] { return comm.iall_gather(src, recv.data(), c, this->kType); });
        expect_values(recv, expected(N * c, [&](uint64_t i) { return value(static_cast<int>(i / c), i % c); }), what);
        expect_traffic(counter.delta(), CommOpKind::kAllGather, (N - 1) * c, (N - 1) * c, this->kBeta, what);
      }
    }
  }
}

TYPED_TEST(CollectivesTest, AllGatherV) {
  using T = TypeParam;
  Communicator& comm = this->comm();
  const int p = comm.rank(), N = comm.size();
  for (const std::vector<size_t>& counts : count_patterns(N)) {
    std::vector<size_t> offsets(N + 1, 0);
    std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
    const size_t total = offsets[N];
    for (Mode mode : kAllModes) {
      for (bool in_place : {false, true}) {
        const std::string what =
            fmt::format("all_gather_v counts={} {} in_place={}", fmt::join(counts, ","), mode_name(mode), in_place);
        std::vector<T> send = filled<T>(counts[p], [&](uint64_t i) { return value(p, i); });
        std::vector<T> recv = filled<T>(total, [](uint64_t) { return 99; });
        if (in_place) std::copy(send.begin(), send.end(), recv.begin() + offsets[p]);
        const T* src = in_place ? recv.data() + offsets[p] : send.data();
        ScopedCommCounter counter(comm);
        run_in_mode(
            mode, [&] { return comm.all_gather_v(src, recv.data(), counts, this->kType); },
            [&] { return comm.iall_gather_v(src, recv.data(), counts, this->kType); });
        expect_values(recv, expected(total, [&](uint64_t i) {
                        const int r = static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), i) -
                                                       offsets.begin()) - 1;
                        return value(r, i - offsets[r]);
                      }), what);
        expect_traffic(counter.delta(), CommOpKind::kAllGatherV, total - counts[(p + 1) % N], total - counts[p],
                       this->kBeta, what);
      }
    }
  }
}

TYPED_TEST(CollectivesTest, ReduceScatter) {
  using T = TypeParam;
  Communicator& comm = this->comm();
  const int p = comm.rank(), N = comm.size();
  for (size_t c : kCounts) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      for (Mode mode : kAllModes) {
        for (bool in_place : {false, true}) {
          const std::string what = fmt::format("reduce_scatter count={} {} {} in_place={}", c, reduce_op_name(op),
                                               mode_name(mode), in_place);
          std::vector<T> send = filled<T>(N * c, [&](uint64_t i) { return value(p, i); });
          std::vector<T> recv = filled<T>(c, [](uint64_t) { return 99; });
          T* dst = in_place ? send.data() + p * c : recv.data();
          ScopedCommCounter counter(comm);
          run_in_mode(
              mode, [&] { return comm.reduce_scatter(send.data(), dst, c, this->kType, op); },
              [&] { return comm.ireduce_scatter(send.data(), dst, c, this->kType, op); });
          std::vector<T> got(dst, dst + c);
          expect_values(got, expected(c, [&](uint64_t i) {
                          return op == ReduceOp::kSum ? sum_over_ranks(N, p * c + i) : max_over_ranks(N, p * c + i);
                        }), what);
          expect_traffic(counter.delta(), CommOpKind::kReduceScatter, (N - 1) * c, (N - 1) * c, this->kBeta, what);
        }
      }
    }
  }
}

TYPED_TEST(CollectivesTest, ReduceScatterV) {
  using T = TypeParam;
  Communicator& comm = this->comm();
  const int p = comm.rank(), N = comm.size();
  for (const std::vector<size_t>& counts : count_patterns(N)) {
    std::vector<size_t> offsets(N + 1, 0);
    std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
    const size_t total = offsets[N];
    for (Mode mode : kAllModes) {
      for (bool in_place : {false, true}) {
        const std::string what =
            fmt::format("reduce_scatter_v counts={} {} in_place={}", fmt::join(counts, ","), mode_name(mode), in_place);
        std::vector<T> send = filled<T>(total, [&](uint64_t i) { return value(p, i); });
        std::vector<T> recv = filled<T>(counts[p], [](uint64_t) { return 99; });
        T* dst = in_place ? send.data() + offsets[p] : recv.data();
        ScopedCommCounter counter(comm);
        run_in_mode(
            mode, [&] { return comm.reduce_scatter_v(send.data(), dst, counts, this->kType, ReduceOp::kSum); },
            [&] { return comm.ireduce_scatter_v(send.data(), dst, counts, this->kType, ReduceOp::kSum); });
        std::vector<T> got(dst, dst + counts[p]);
        expect_values(got, expected(counts[p], [&](uint64_t i) { return sum_over_ranks(N, offsets[p] + i); }), what);
        expect_traffic(counter.delta(), CommOpKind::kReduceScatterV, total - counts[p],
                       total - counts[(p + N - 1) % N], this->kBeta, what);
      }
    }
  }
}

TYPED_TEST(CollectivesTest, AllToAll) {
  using T = TypeParam;
  Communicator& comm = this->comm();
  const int p = comm.rank(), N = comm.size();
  // Element i of the block rank s sends to rank d: value(s * N + d, i).
  for (size_t c : kCounts) {
    for (Mode mode : kAllModes) {
      const std::string what = fmt::format("all_to_all count={} {}", c, mode_name(mode));
      std::vector<T> send = filled<T>(N * c, [&](uint64_t i) { return value(p * N + static_cast<int>(i / c), i % c); });
      std::vector<T> recv = filled<T>(N * c, [](uint64_t) { return 99; });
      ScopedCommCounter counter(comm);
      run_in_mode(
          mode, [&] { return comm.all_to_all(send.data(), recv.data(), c, this->kType); },
          [&] { return comm.iall_to_all(send.data(), recv.data(), c, this->kType); });
      expect_values(recv, expected(N * c, [&](uint64_t i) { return value(static_cast<int>(i / c) * N + p, i % c); }),
                    what);
      expect_traffic(counter.delta(), CommOpKind::kAllToAll, (N - 1) * c, (N - 1) * c, this->kBeta, what);
    }
  }
}

TEST(Collectives, BarrierCountsOneCallAndNoBytes) {
  Communicator& comm = mpi().world();
  for (Mode mode : kAllModes) {
    ScopedCommCounter counter(comm);
    const uint64_t seq_before = comm.collectives_submitted();
    run_in_mode(mode, [&] { return comm.barrier(); }, [&] { return comm.ibarrier(); });
    expect_traffic(counter.delta(), CommOpKind::kBarrier, 0, 0, 1, mode_name(mode));
    EXPECT_EQ(comm.collectives_submitted(), seq_before + 1);
  }
}

// The sum over ranks of what each rank sends equals the sum of what each receives, and for
// all_reduce it is 2 (N-1) n elements, whatever n mod N.
TEST(Collectives, AllReduceTrafficIsConservedAcrossRanks) {
  Communicator& comm = mpi().world();
  const int N = comm.size();
  for (size_t n : kCounts) {
    std::vector<float> x(n, 1.0f);
    ScopedCommCounter counter(comm);
    ASSERT_TRUE(comm.all_reduce(x.data(), x.data(), n, DType::kF32, ReduceOp::kSum).ok());
    const OpCounters mine = counter.delta().op(CommOpKind::kAllReduce);
    const int64_t local[2] = {static_cast<int64_t>(mine.bytes_sent), static_cast<int64_t>(mine.bytes_received)};
    int64_t sums[2] = {0, 0};
    ASSERT_TRUE(comm.all_reduce(local, sums, 2, DType::kI64, ReduceOp::kSum).ok());
    EXPECT_EQ(sums[0], static_cast<int64_t>(2 * (N - 1) * n * 4)) << "n=" << n;
    EXPECT_EQ(sums[1], sums[0]) << "n=" << n;
  }
}

// start_group: each op's result, counters and sequence number as if started one by one (an
// all_gather, a reduce_scatter and an all_reduce in one group).
TEST(Collectives, AGroupIsItsOperationsInOrder) {
  Communicator& comm = mpi().world();
  const int N = comm.size(), r = comm.rank();
  const size_t n = 7;
  std::vector<float> mine(n), gathered(n * N, -1.0f), blocks(n * N), scattered(n, -1.0f), summed(n, -1.0f);
  for (size_t i = 0; i < n; ++i) mine[i] = static_cast<float>(value(r, i));
  for (size_t i = 0; i < n * N; ++i) blocks[i] = static_cast<float>(value(r, i));
  CommOp gather, scatter, reduce;
  gather.kind = CommOpKind::kAllGather;
  gather.send_buf = mine.data();
  gather.recv_buf = gathered.data();
  gather.count = n;
  scatter.kind = CommOpKind::kReduceScatter;
  scatter.send_buf = blocks.data();
  scatter.recv_buf = scattered.data();
  scatter.count = n;
  reduce.kind = CommOpKind::kAllReduce;
  reduce.send_buf = mine.data();
  reduce.recv_buf = summed.data();
  reduce.count = n;
  const uint64_t seq_before = comm.collectives_submitted();
  ScopedCommCounter counter(comm);
  const CommOp ops[] = {gather, scatter, reduce};
  std::vector<CommRequest> requests = comm.start_group(ops);
  ASSERT_EQ(requests.size(), 3u);
  for (CommRequest& q : requests) ASSERT_TRUE(q.wait().ok());
  EXPECT_EQ(comm.collectives_submitted(), seq_before + 3);
  const CommStats delta = counter.delta();
  EXPECT_EQ(delta.op(CommOpKind::kAllGather).calls, 1u);
  EXPECT_EQ(delta.op(CommOpKind::kReduceScatter).calls, 1u);
  EXPECT_EQ(delta.op(CommOpKind::kAllReduce).calls, 1u);
  for (int p = 0; p < N; ++p)
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(gathered[p * n + i], value(p, i)) << "gathered block " << p;
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(scattered[i], sum_over_ranks(N, r * n + i)) << i;
    EXPECT_EQ(summed[i], sum_over_ranks(N, i)) << i;
  }
}

// Large non-blocking all-reduces completed in a different order on each rank, with a large
// blocking one (the MPI backend's pairwise path) on the same communicator between their
// start and their waits. A two-phase non-blocking all-reduce whose second phase starts when
// the waiting rank finishes the first (an all-gather after the reduction) deadlocks here:
// each rank waits for the peer's second phase of the other request.
TEST(Collectives, LargeNonBlockingAllReducesCompleteInAnyOrder) {
  Communicator& comm = mpi().world();
  const int N = comm.size(), r = comm.rank();
  const size_t n = (size_t{1} << 20) / sizeof(float) + 5;  // over 1 MiB
  std::vector<float> a(n), b(n), c(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = static_cast<float>(value(r, i));
    b[i] = static_cast<float>(value(r, i + 3));
    c[i] = static_cast<float>(value(r, i + 5));
  }
  CommRequest qa = comm.iall_reduce(a.data(), a.data(), n, DType::kF32, ReduceOp::kSum);
  CommRequest qb = comm.iall_reduce(b.data(), b.data(), n, DType::kF32, ReduceOp::kMax);
  ASSERT_TRUE(comm.all_reduce(c.data(), c.data(), n, DType::kF32, ReduceOp::kSum).ok());
  if (r % 2 == 0) {
    ASSERT_TRUE(qa.wait().ok());
    ASSERT_TRUE(qb.wait().ok());
  } else {
    bool done = false;
    while (!done) ASSERT_TRUE(qb.test(&done).ok());
    ASSERT_TRUE(qa.wait().ok());
  }
  for (size_t i = 0; i < n; i += 997) {
    ASSERT_EQ(a[i], sum_over_ranks(N, i)) << i;
    ASSERT_EQ(b[i], max_over_ranks(N, i + 3)) << i;
    ASSERT_EQ(c[i], sum_over_ranks(N, i + 5)) << i;
  }
  ASSERT_EQ(a[n - 1], sum_over_ranks(N, n - 1));
}

}  // namespace
}  // namespace foldpar::test
