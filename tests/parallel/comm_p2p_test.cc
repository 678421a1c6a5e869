// Point-to-point operations (send, recv, send_recv ring steps) in every mode, and several
// non-blocking operations in flight at once, completed out of order: exact data, exact
// counters, and sequence numbers that count collectives only. Runs under mpirun at 1-4 ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "comm/communicator.h"
#include "comm_test_util.h"
#include "mpi_test_main.h"

namespace foldpar::test {
namespace {

constexpr size_t kCounts[] = {0, 1, 7, 1027};

template <typename T>
void check_ring(Communicator& comm, int direction) {
  const int p = comm.rank(), N = comm.size();
  const int peer = (p + direction + N) % N, source = (p - direction + N) % N;
  for (size_t n : kCounts) {
    for (Mode mode : kAllModes) {
      const std::string what = fmt::format("send_recv {} n={} direction={} {}", dtype_name(DTypeOf<T>::value), n,
                                           direction, mode_name(mode));
      std::vector<T> send = filled<T>(n, [&](uint64_t i) { return value(p, i); });
      std::vector<T> recv = filled<T>(n, [](uint64_t) { return 99; });
      ScopedCommCounter counter(comm);
      const uint64_t seq = comm.collectives_submitted();
      run_in_mode(
          mode, [&] { return comm.send_recv(send.data(), recv.data(), n, DTypeOf<T>::value, peer, source); },
          [&] { return comm.isend_recv(send.data(), recv.data(), n, DTypeOf<T>::value, peer, source); });
      std::vector<double> want(n);
      for (size_t i = 0; i < n; ++i) want[i] = value(source, i);
      expect_values(recv, want, what);
      // A transfer to oneself (N == 1) is a local copy: no bytes.
      expect_traffic(counter.delta(), CommOpKind::kSendRecv, peer == p ? 0 : n, source == p ? 0 : n, sizeof(T), what);
      EXPECT_EQ(comm.collectives_submitted(), seq) << what << ": point-to-point must not number collectives";
    }
  }
}

TEST(PointToPoint, SendRecvRingForwardAndBackward) {
  Communicator& comm = mpi().world();
  for (int direction : {+1, -1}) {
    check_ring<float>(comm, direction);
    check_ring<bf16>(comm, direction);
  }
}

// Blocking send and recv between neighbours 0<->1, 2<->3 (a last odd rank sits out).
TEST(PointToPoint, BlockingSendAndRecvInPairs) {
  Communicator& comm = mpi().world();
  const int p = comm.rank(), N = comm.size();
  const int partner = p % 2 == 0 ? p + 1 : p - 1;
  if (partner >= N) GTEST_SKIP() << "rank " << p << " has no partner";
  for (size_t n : kCounts) {
    std::vector<float> mine = filled<float>(n, [&](uint64_t i) { return value(p, i); });
    std::vector<float> theirs(n, 99.0f);
    ScopedCommCounter counter(comm);
    if (p % 2 == 0) {
      ASSERT_TRUE(comm.send(mine.data(), n, DType::kF32, partner).ok());
      ASSERT_TRUE(comm.recv(theirs.data(), n, DType::kF32, partner).ok());
    } else {
      ASSERT_TRUE(comm.recv(theirs.data(), n, DType::kF32, partner).ok());
      ASSERT_TRUE(comm.send(mine.data(), n, DType::kF32, partner).ok());
    }
    std::vector<double> want(n);
    for (size_t i = 0; i < n; ++i) want[i] = value(partner, i);
    expect_values(theirs, want, fmt::format("send/recv n={}", n));
    const CommStats d = counter.delta();
    EXPECT_EQ(d.op(CommOpKind::kSend), (OpCounters{1, n * 4, 0})) << "n=" << n;
    EXPECT_EQ(d.op(CommOpKind::kRecv), (OpCounters{1, 0, n * 4})) << "n=" << n;
  }
}

// isend to p+1 and irecv from p-1, waited in either order or tested; with one rank, to itself.
TEST(PointToPoint, NonBlockingSendAndRecvRing) {
  Communicator& comm = mpi().world();
  const int p = comm.rank(), N = comm.size();
  for (size_t n : kCounts) {
    for (bool recv_first : {false, true}) {
      std::vector<bf16> send = filled<bf16>(n, [&](uint64_t i) { return value(p, i); });
      std::vector<bf16> recv = filled<bf16>(n, [](uint64_t) { return 99; });
      ScopedCommCounter counter(comm);
      CommRequest r = comm.irecv(recv.data(), n, DType::kBF16, (p + N - 1) % N);
      CommRequest s = comm.isend(send.data(), n, DType::kBF16, (p + 1) % N);
      if (recv_first) {
        EXPECT_TRUE(r.wait().ok());
        bool done = false;
        while (!done) EXPECT_TRUE(s.test(&done).ok());
      } else {
        EXPECT_TRUE(s.wait().ok());
        EXPECT_TRUE(r.wait().ok());
      }
      EXPECT_TRUE(r.wait().ok()) << "wait() after completion returns the same status";
      std::vector<double> want(n);
      for (size_t i = 0; i < n; ++i) want[i] = value((p + N - 1) % N, i);
      expect_values(recv, want, fmt::format("isend/irecv n={}", n));
      const uint64_t bytes = N == 1 ? 0 : n * 2;
      EXPECT_EQ(counter.delta().op(CommOpKind::kSend), (OpCounters{1, bytes, 0}));
      EXPECT_EQ(counter.delta().op(CommOpKind::kRecv), (OpCounters{1, 0, bytes}));
    }
  }
}

// What a schedule does: start the next transfers, then wait for them in another order.
TEST(NonBlocking, SeveralOperationsInFlightCompleteInAnyOrder) {
  Communicator& comm = mpi().world();
  const int p = comm.rank(), N = comm.size();
  const size_t n = 1000;
  std::vector<float> bcast = filled<float>(n, [&](uint64_t i) { return p == N - 1 ? value(N - 1, i) : 99; });
  std::vector<float> mine = filled<float>(n, [&](uint64_t i) { return value(p, i); });
  std::vector<float> gathered(N * n, 99.0f), reduced(n, 99.0f), ring(n, 99.0f), scattered(n, 99.0f);
  std::vector<float> to_scatter = filled<float>(N * n, [&](uint64_t i) { return value(p, i); });
  ScopedCommCounter counter(comm);
  const uint64_t seq = comm.collectives_submitted();
  std::vector<CommRequest> requests;
  requests.push_back(comm.ibroadcast(bcast.data(), n, DType::kF32, N - 1));
  requests.push_back(comm.iall_gather(mine.data(), gathered.data(), n, DType::kF32));
  requests.push_back(comm.isend_recv(mine.data(), ring.data(), n, DType::kF32, (p + 1) % N, (p + N - 1) % N));
  requests.push_back(comm.iall_reduce(mine.data(), reduced.data(), n, DType::kF32, ReduceOp::kSum));
  requests.push_back(comm.ireduce_scatter(to_scatter.data(), scattered.data(), n, DType::kF32, ReduceOp::kSum));
  EXPECT_EQ(comm.collectives_submitted(), seq + 4);
  // Poll all with test() for a while (a schedule computing between polls), then wait for
  // the rest from last to first.
  for (int round = 0; round < 3; ++round) {
    for (CommRequest& r : requests) {
      bool done = false;
      EXPECT_TRUE(r.test(&done).ok());
    }
  }
  for (auto it = requests.rbegin(); it != requests.rend(); ++it) EXPECT_TRUE(it->wait().ok());

  std::vector<double> want_bcast(n), want_gather(N * n), want_reduce(n), want_ring(n), want_scatter(n);
  for (size_t i = 0; i < n; ++i) {
    want_bcast[i] = value(N - 1, i);
    want_ring[i] = value((p + N - 1) % N, i);
    for (int r = 0; r < N; ++r) {
      want_gather[r * n + i] = value(r, i);
      want_reduce[i] += value(r, i);
      want_scatter[i] += value(r, p * n + i);
    }
  }
  expect_values(bcast, want_bcast, "ibroadcast");
  expect_values(gathered, want_gather, "iall_gather");
  expect_values(ring, want_ring, "isend_recv");
  expect_values(reduced, want_reduce, "iall_reduce");
  expect_values(scattered, want_scatter, "ireduce_scatter");
  const CommStats d = counter.delta();
  for (CommOpKind k : {CommOpKind::kBroadcast, CommOpKind::kAllGather, CommOpKind::kSendRecv, CommOpKind::kAllReduce,
                       CommOpKind::kReduceScatter}) {
    EXPECT_EQ(d.op(k).calls, 1u) << comm_op_name(k);
  }
  EXPECT_EQ(d.total().calls, 5u);
}

}  // namespace
}  // namespace foldpar::test
