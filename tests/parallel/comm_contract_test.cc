// The MPI backend's side of the contract: the world matches the launcher, refusals are
// Statuses that count nothing, every dtype travels exactly, bf16 sums accumulate in f32,
// large messages (rendezvous protocol) arrive intact, and a TSP layer's forward
// communication counts exactly the elements of docs/tsp.md section 7. Runs at 1-4 ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "comm/communicator.h"
#include "comm_test_util.h"
#include "mpi_test_main.h"

namespace foldpar::test {
namespace {

TEST(Contract, WorldMatchesTheLauncher) {
  Communicator& world = mpi().world();
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  ASSERT_NE(size, nullptr) << "not started by OpenMPI's mpirun";
  ASSERT_NE(rank, nullptr);
  EXPECT_EQ(world.size(), std::atoi(size));
  EXPECT_EQ(world.rank(), std::atoi(rank));
  EXPECT_EQ(world.name(), "world");
  const std::string members = world.size() == 1   ? "world (world rank 0)"
                              : world.size() == 2 ? "world (world ranks 0,1)"
                                                  : fmt::format("world (world ranks 0-{})", world.size() - 1);
  EXPECT_EQ(world.describe(), members);
}

TEST(Contract, StreamIsUnimplementedOnMpiAndCountsNothing) {
  Communicator& comm = mpi().world();
  int dummy = 0;
  const CommStream stream{&dummy};
  float x[4] = {1, 2, 3, 4};
  ScopedCommCounter counter(comm);
  const uint64_t seq = comm.collectives_submitted();
  const Status blocking = comm.all_reduce(x, x, 4, DType::kF32, ReduceOp::kSum, stream);
  EXPECT_EQ(blocking.code(), StatusCode::kUnimplemented);
  EXPECT_NE(blocking.message().find("all_reduce on communicator world"), std::string::npos) << blocking.message();
  EXPECT_NE(blocking.message().find("stream"), std::string::npos) << blocking.message();
  std::vector<float> gathered(comm.size());
  CommRequest request = comm.iall_gather(x, gathered.data(), 1, DType::kF32, stream);
  bool done = false;
  EXPECT_EQ(request.test(&done).code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(done);
  EXPECT_EQ(request.wait().code(), StatusCode::kUnimplemented);
  EXPECT_EQ(counter.delta().total(), OpCounters{});
  EXPECT_EQ(comm.collectives_submitted(), seq);
}

template <typename T>
void check_dtype_round_trip(Communicator& comm) {
  const int p = comm.rank(), N = comm.size();
  const DType t = DTypeOf<T>::value;
  const size_t n = 33;
  std::vector<T> mine = filled<T>(n, [&](uint64_t i) { return value(p, i) * 1000; });
  std::vector<T> sum(n), gathered(N * n);
  ASSERT_TRUE(comm.all_reduce(mine.data(), sum.data(), n, t, ReduceOp::kSum).ok());
  ASSERT_TRUE(comm.all_gather(mine.data(), gathered.data(), n, t).ok());
  std::vector<double> want_sum(n, 0), want_gather(N * n);
  for (int r = 0; r < N; ++r) {
    for (size_t i = 0; i < n; ++i) {
      want_sum[i] += value(r, i) * 1000;
      want_gather[r * n + i] = value(r, i) * 1000;
    }
  }
  expect_values(sum, want_sum, fmt::format("all_reduce {}", dtype_name(t)));
  expect_values(gathered, want_gather, fmt::format("all_gather {}", dtype_name(t)));
}

TEST(Contract, EveryDTypeTravelsExactly) {
  Communicator& comm = mpi().world();
  check_dtype_round_trip<float>(comm);
  check_dtype_round_trip<double>(comm);
  check_dtype_round_trip<int32_t>(comm);
  check_dtype_round_trip<int64_t>(comm);
}

// Rank 0 contributes 256, every other rank 1. In bf16 (8 significant bits) 256 + 1 rounds
// back to 256, so adding one contribution at a time in bf16 would return 256 at any N; the
// layer sums in f32 and rounds once: bf16(255 + N), e.g. 258 at N = 3 and 260 at N = 4.
TEST(Contract, Bf16SumsAccumulateInF32) {
  Communicator& comm = mpi().world();
  const int p = comm.rank(), N = comm.size();
  const double exact = 255.0 + N;
  const double want = bf16_to_f32(f32_to_bf16(static_cast<float>(exact)));
  const size_t n = 8;
  std::vector<bf16> mine(N * n, f32_to_bf16(p == 0 ? 256.0f : 1.0f));
  std::vector<bf16> all(n), scattered(n), root(n);
  ASSERT_TRUE(comm.all_reduce(mine.data(), all.data(), n, DType::kBF16, ReduceOp::kSum).ok());
  ASSERT_TRUE(comm.reduce_scatter(mine.data(), scattered.data(), n, DType::kBF16, ReduceOp::kSum).ok());
  ASSERT_TRUE(comm.reduce(mine.data(), root.data(), n, DType::kBF16, ReduceOp::kSum, N - 1).ok());
  CommRequest r = comm.iall_reduce(mine.data(), mine.data(), n, DType::kBF16, ReduceOp::kSum);
  ASSERT_TRUE(r.wait().ok());
  const std::vector<double> expected(n, want);
  expect_values(all, expected, "all_reduce");
  expect_values(scattered, expected, "reduce_scatter");
  if (p == N - 1) {
    expect_values(root, expected, "reduce");
  }
  expect_values(std::vector<bf16>(mine.begin(), mine.begin() + n), expected, "iall_reduce in place");
  if (N == 3) {
    EXPECT_EQ(want, 258.0);
  }
}

// Messages beyond the eager limit take MPI's rendezvous path (and, on one node, its
// single-copy mechanism): 4 MiB each.
TEST(Contract, LargeMessagesArriveIntact) {
  Communicator& comm = mpi().world();
  const int p = comm.rank(), N = comm.size();
  const size_t n = size_t{1} << 20;
  for (Mode mode : kAllModes) {
    std::vector<float> mine = filled<float>(n, [&](uint64_t i) { return value(p, i); });
    std::vector<float> sum(n), ring(n), bcast = mine;
    run_in_mode(mode, [&] { return comm.all_reduce(mine.data(), sum.data(), n, DType::kF32, ReduceOp::kSum); },
                [&] { return comm.iall_reduce(mine.data(), sum.data(), n, DType::kF32, ReduceOp::kSum); });
    run_in_mode(mode, [&] { return comm.broadcast(bcast.data(), n, DType::kF32, 0); },
                [&] { return comm.ibroadcast(bcast.data(), n, DType::kF32, 0); });
    run_in_mode(
        mode, [&] { return comm.send_recv(mine.data(), ring.data(), n, DType::kF32, (p + 1) % N, (p + N - 1) % N); },
        [&] { return comm.isend_recv(mine.data(), ring.data(), n, DType::kF32, (p + 1) % N, (p + N - 1) % N); });
    std::vector<double> want_sum(n, 0), want_bcast(n), want_ring(n);
    for (size_t i = 0; i < n; ++i) {
      for (int r = 0; r < N; ++r) want_sum[i] += value(r, i);
      want_bcast[i] = value(0, i);
      want_ring[i] = value((p + N - 1) % N, i);
    }
    expect_values(sum, want_sum, fmt::format("all_reduce 4 MiB {}", mode_name(mode)));
    expect_values(bcast, want_bcast, fmt::format("broadcast 4 MiB {}", mode_name(mode)));
    expect_values(ring, want_ring, fmt::format("send_recv 4 MiB {}", mode_name(mode)));
  }
}

// The forward communication of one TSP layer (docs/tsp.md sections 4 and 7) with small
// dimensions, in bf16: D broadcasts of the packed attention shard (roots 0..D-1), the K and
// V all-gathers of each shard, and D-1 ring hops of the packed MLP shard. Per rank, the
// counters must equal docs/tsp.md section 7's table exactly:
//   weights:     ((2 + 2/g) h^2 (D-1)/D + 3 h f (D-1)/D) * beta, sent and received
//   activations: 2 B S h/g (D-1)/D * beta, received (all-gathers also send as much)
TEST(Contract, TspLayerForwardTrafficMatchesSpecSection7) {
  Communicator& tsp = mpi().world();
  const int p = tsp.rank(), D = tsp.size();
  const uint64_t B = 2, S = 24, h = 12, g = 1, f = 24, beta = 2;  // S % 2D == 0, h % D == 0, f % D == 0
  const uint64_t attn_shard = (2 * h * h + 2 * h * h / g) / D;     // [Wq|Wk|Wv|Wo] of rank r
  const uint64_t mlp_shard = 3 * h * f / D;                        // [Wgate|Wup|Wdown]
  const uint64_t kv_local = B * (S / D) * (h / (g * D));           // K (or V) of one shard, local tokens
  std::vector<bf16> attn(attn_shard), mlp_cur(mlp_shard), mlp_next(mlp_shard), k(kv_local), v(kv_local);
  std::vector<bf16> k_all(D * kv_local), v_all(D * kv_local);
  ScopedCommCounter counter(tsp);
  for (int r = 0; r < D; ++r) {
    ASSERT_TRUE(tsp.broadcast(attn.data(), attn_shard, DType::kBF16, r).ok());
    ASSERT_TRUE(tsp.all_gather(k.data(), k_all.data(), kv_local, DType::kBF16).ok());
    ASSERT_TRUE(tsp.all_gather(v.data(), v_all.data(), kv_local, DType::kBF16).ok());
  }
  for (int j = 0; j + 1 < D; ++j) {
    ASSERT_TRUE(tsp.send_recv(mlp_cur.data(), mlp_next.data(), mlp_shard, DType::kBF16, (p + 1) % D,
                              (p + D - 1) % D).ok());
    std::swap(mlp_cur, mlp_next);
  }
  const CommStats d = counter.delta();
  const uint64_t weights = ((2 * h * h + 2 * h * h / g) * (D - 1) / D + 3 * h * f * (D - 1) / D) * beta;
  const uint64_t activations = 2 * B * S * h / g * (D - 1) / D * beta;
  const OpCounters bcast = d.op(CommOpKind::kBroadcast), ring = d.op(CommOpKind::kSendRecv);
  EXPECT_EQ(bcast.bytes_received + ring.bytes_received, weights) << d.to_string();
  EXPECT_EQ(bcast.bytes_sent + ring.bytes_sent, weights) << d.to_string();
  EXPECT_EQ(d.op(CommOpKind::kAllGather).bytes_received, activations) << d.to_string();
  EXPECT_EQ(d.op(CommOpKind::kAllGather).bytes_sent, activations) << d.to_string();
  EXPECT_EQ(d.total().calls, static_cast<uint64_t>(3 * D + D - 1));
}

}  // namespace
}  // namespace foldpar::test
