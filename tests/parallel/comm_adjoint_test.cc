// Adjoint tests of every communication pair: for random integer-valued x and y,
//   sum over ranks of <fwd(x), y> == sum over ranks of <x, bwd(y)>
// exactly (integers, f64 inner products). Pairs: broadcast / reduce (every root),
// all_gather / reduce_scatter (equal and variable counts, f32 and bf16), ring send forward /
// backward, and the self-adjoint all_reduce and all_to_all. Runs under mpirun at 1-4 ranks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <numeric>

#include "comm/communicator.h"
#include "comm_test_util.h"
#include "core/rng.h"
#include "mpi_test_main.h"

namespace foldpar::test {
namespace {

// Random integers in [-8, 8], different per rank and per tensor name.
template <typename T>
std::vector<T> random_ints(size_t n, int rank, std::string_view name) {
  const uint64_t stream = stream_id(name) + static_cast<uint64_t>(rank);
  return filled<T>(n, [&](uint64_t i) { return static_cast<double>(hash_u64(1234, stream, i) % 17) - 8.0; });
}

template <typename T>
double dot(const std::vector<T>& a, const std::vector<T>& b) {
  EXPECT_EQ(a.size(), b.size());
  double s = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) s += to_double(a[i]) * to_double(b[i]);
  return s;
}

// Sum over the ranks of the communicator (exact for integers below 2^53).
double sum_over_ranks(Communicator& comm, double local) {
  double total = 0;
  EXPECT_TRUE(comm.all_reduce(&local, &total, 1, DType::kF64, ReduceOp::kSum).ok());
  return total;
}

void expect_adjoint(Communicator& comm, double fwd_local, double bwd_local, const std::string& what) {
  const double lhs = sum_over_ranks(comm, fwd_local), rhs = sum_over_ranks(comm, bwd_local);
  EXPECT_EQ(lhs, rhs) << what << ": sum <fwd(x), y> = " << lhs << " but sum <x, bwd(y)> = " << rhs;
}

TEST(Adjoint, BroadcastAndReduce) {
  Communicator& comm = mpi().world();
  const int p = comm.rank(), N = comm.size();
  for (size_t n : {size_t{1}, size_t{7}, size_t{1000}}) {
    for (int root = 0; root < N; ++root) {
      // fwd: every rank gets the root's x. bwd: the root gets the sum of y; x off the root
      // is not an input of the broadcast, so its adjoint there is 0.
      const std::vector<float> x = random_ints<float>(n, p, "x"), y = random_ints<float>(n, p, "y");
      std::vector<float> fx = x, by(n, 0.0f);
      ASSERT_TRUE(comm.broadcast(fx.data(), n, DType::kF32, root).ok());
      ASSERT_TRUE(comm.reduce(y.data(), p == root ? by.data() : nullptr, n, DType::kF32, ReduceOp::kSum, root).ok());
      expect_adjoint(comm, dot(fx, y), p == root ? dot(x, by) : 0.0, fmt::format("broadcast/reduce n={} root={}", n, root));
    }
  }
}

template <typename T>
void check_gather_scatter(Communicator& comm, const std::vector<size_t>& counts, bool variable) {
  const int p = comm.rank();
  const DType t = DTypeOf<T>::value;
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  // fwd: all_gather x [counts[p]] -> [total]; bwd: reduce_scatter y [total] -> [counts[p]].
  const std::vector<T> x = random_ints<T>(counts[p], p, "x"), y = random_ints<T>(total, p, "y");
  std::vector<T> fx(total), by(counts[p]);
  if (variable) {
    ASSERT_TRUE(comm.all_gather_v(x.data(), fx.data(), counts, t).ok());
    ASSERT_TRUE(comm.reduce_scatter_v(y.data(), by.data(), counts, t, ReduceOp::kSum).ok());
  } else {
    ASSERT_TRUE(comm.all_gather(x.data(), fx.data(), counts[0], t).ok());
    ASSERT_TRUE(comm.reduce_scatter(y.data(), by.data(), counts[0], t, ReduceOp::kSum).ok());
  }
  expect_adjoint(comm, dot(fx, y), dot(x, by),
                 fmt::format("all_gather{0}/reduce_scatter{0} {1} counts={2}", variable ? "_v" : "", dtype_name(t),
                             fmt::join(counts, ",")));
}

TEST(Adjoint, AllGatherAndReduceScatter) {
  Communicator& comm = mpi().world();
  const int N = comm.size();
  for (size_t c : {size_t{1}, size_t{5}, size_t{300}}) {
    check_gather_scatter<float>(comm, std::vector<size_t>(N, c), false);
    check_gather_scatter<bf16>(comm, std::vector<size_t>(N, c), false);
  }
  std::vector<size_t> uneven(N);
  for (int r = 0; r < N; ++r) uneven[r] = (3 * r + 2) % 5;  // 2, 0, 3, 1: zeros and totals not divisible by N
  check_gather_scatter<float>(comm, uneven, true);
  check_gather_scatter<bf16>(comm, uneven, true);
}

TEST(Adjoint, RingSendForwardAndBackward) {
  Communicator& comm = mpi().world();
  const int p = comm.rank(), N = comm.size();
  const int next = (p + 1) % N, prev = (p + N - 1) % N;
  for (size_t n : {size_t{1}, size_t{7}, size_t{1000}}) {
    // fwd: rank p receives x of p-1. bwd: y travels the other way, rank p receives y of p+1.
    const std::vector<float> x = random_ints<float>(n, p, "x"), y = random_ints<float>(n, p, "y");
    std::vector<float> fx(n), by(n);
    ASSERT_TRUE(comm.send_recv(x.data(), fx.data(), n, DType::kF32, next, prev).ok());
    CommRequest back = comm.isend_recv(y.data(), by.data(), n, DType::kF32, prev, next);
    ASSERT_TRUE(back.wait().ok());
    expect_adjoint(comm, dot(fx, y), dot(x, by), fmt::format("ring send n={}", n));
  }
}

TEST(Adjoint, AllReduceAndAllToAllAreSelfAdjoint) {
  Communicator& comm = mpi().world();
  const int p = comm.rank(), N = comm.size();
  const size_t c = 13;
  const std::vector<float> x = random_ints<float>(N * c, p, "x"), y = random_ints<float>(N * c, p, "y");
  std::vector<float> fx(N * c), by(N * c);
  ASSERT_TRUE(comm.all_reduce(x.data(), fx.data(), N * c, DType::kF32, ReduceOp::kSum).ok());
  ASSERT_TRUE(comm.all_reduce(y.data(), by.data(), N * c, DType::kF32, ReduceOp::kSum).ok());
  expect_adjoint(comm, dot(fx, y), dot(x, by), "all_reduce");
  ASSERT_TRUE(comm.all_to_all(x.data(), fx.data(), c, DType::kF32).ok());
  ASSERT_TRUE(comm.all_to_all(y.data(), by.data(), c, DType::kF32).ok());
  expect_adjoint(comm, dot(fx, y), dot(x, by), "all_to_all");
}

}  // namespace
}  // namespace foldpar::test
