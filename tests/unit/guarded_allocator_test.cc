// The device-memory stand-in's allocator and backend (tensor/guarded_allocator.h,
// backend/guarded_backend.h): guarded tensor memory is readable only inside a window (a
// Backend op, an explicit host copy), and the negative control: a deliberate host read of a
// tensor between ops kills the process with the fault handler's message, so the MPI test
// that runs whole steps under the guard (tests/parallel/guarded_memory_test.cc) would fail
// at the first host touch.
#include <gtest/gtest.h>

#include <vector>

#include "backend/guarded_backend.h"
#include "comm/guarded_communicator.h"
#include "comm/self_communicator.h"
#include "tensor/guarded_allocator.h"

namespace foldpar {
namespace {

struct Guarded {
  GuardedAllocator guard{size_t{1} << 30};
  MemoryTracker tracker;
  Guarded() {
    install_storageless_fault_handler();
    tracker.set_block_allocator(&guard);
  }
};

constexpr const char* kCaught = "host access to address .* inside guarded tensor memory outside a Backend op";

TEST(GuardedAllocator, ExplicitCopiesAndZerosWorkWhileClosed) {
  Guarded g;
  Tensor t = Tensor::zeros({3, 5}, DType::kF32, MemCategory::kActivations, g.tracker);
  EXPECT_FALSE(g.guard.is_open());
  std::vector<float> back = read_host_f32(t);
  EXPECT_EQ(back, std::vector<float>(15, 0.0f));
  std::vector<float> v(15);
  for (int i = 0; i < 15; ++i) v[i] = 0.5f * static_cast<float>(i);
  write_host_f32(v, t);
  EXPECT_EQ(read_host_f32(t), v);
  EXPECT_FALSE(g.guard.is_open());
  {
    GuardOpen outer(&g.guard);
    GuardOpen inner(&g.guard);  // windows nest
    EXPECT_EQ(t.data<float>()[7], 3.5f);
  }
  EXPECT_FALSE(g.guard.is_open());
  // A block allocated while a window is open is open too, and closes with the rest.
  GuardOpen window(&g.guard);
  Tensor big = Tensor::empty({1 << 16}, DType::kF32, MemCategory::kActivations, g.tracker);
  big.data<float>()[(1 << 16) - 1] = 1.0f;
  EXPECT_EQ(big.data<float>()[(1 << 16) - 1], 1.0f);
}

TEST(GuardedAllocator, BackendOpsRunAndLeaveTheMemoryClosed) {
  Guarded g;
  auto cpu = make_cpu_backend();
  auto be = make_guarded_backend(*cpu, g.guard);
  Tensor x = Tensor::empty({4, 8}, DType::kF32, MemCategory::kActivations, g.tracker);
  be->fill(2.0, x);
  EXPECT_FALSE(g.guard.is_open());
  EXPECT_DOUBLE_EQ(be->sum_squares(x), 4.0 * 32);
  std::vector<float> host(32);
  be->copy_to_host(x, std::as_writable_bytes(std::span<float>(host)));
  EXPECT_EQ(host, std::vector<float>(32, 2.0f));
  EXPECT_GT(g.guard.windows_opened(), 2);
  EXPECT_FALSE(g.guard.is_open());
}

// A communicator call reads and writes guarded buffers with the window open; a
// non-blocking one holds it open until wait() sees it complete, then it closes.
TEST(GuardedCommunicator, HoldsTheWindowWhileATransferIsInFlight) {
  Guarded g;
  SelfCommunicator self("tsp", 0);
  std::unique_ptr<Communicator> comm = make_guarded_communicator(self, nullptr, g.guard);
  Tensor a = Tensor::empty({64}, DType::kF32, MemCategory::kComm, g.tracker);
  Tensor b = Tensor::zeros({64}, DType::kF32, MemCategory::kComm, g.tracker);
  std::vector<float> v(64);
  for (int i = 0; i < 64; ++i) v[i] = static_cast<float>(i);
  write_host_f32(v, a);
  ASSERT_TRUE(comm->all_reduce(a.raw_data(), b.raw_data(), 64, DType::kF32, ReduceOp::kSum).ok());
  EXPECT_FALSE(g.guard.is_open());
  EXPECT_EQ(read_host_f32(b), v);
  write_host_f32(std::vector<float>(64, 0.0f), b);
  CommRequest r = comm->isend_recv(a.raw_data(), b.raw_data(), 64, DType::kF32, 0, 0);
  EXPECT_TRUE(g.guard.is_open());
  ASSERT_TRUE(r.wait().ok());
  EXPECT_FALSE(g.guard.is_open());
  EXPECT_EQ(read_host_f32(b), v);
}

// The negative control: the same read that succeeds inside a window kills the process outside one.
TEST(GuardedAllocatorDeathTest, HostReadBetweenOpsIsCaught) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Guarded g;
        auto cpu = make_cpu_backend();
        auto be = make_guarded_backend(*cpu, g.guard);
        Tensor x = Tensor::empty({4, 8}, DType::kF32, MemCategory::kActivations, g.tracker);
        be->fill(1.0, x);
        volatile float v = x.data<float>()[3];  // a host read of tensor data: must fault
        (void)v;
      },
      kCaught);
}

TEST(GuardedAllocatorDeathTest, HostWriteOfAFreshTensorIsCaught) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Guarded g;
        Tensor x = Tensor::empty({16}, DType::kI32, MemCategory::kActivations, g.tracker);
        x.data<int32_t>()[0] = 1;  // a host write, as a loader filling ids in place would do
      },
      kCaught);
}

}  // namespace
}  // namespace foldpar
