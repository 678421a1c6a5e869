// The MPI backend's staging buffers (comm/scratch_pool.h): a buffer given back is handed out
// again for the same size (no fresh pages per call), never one more than twice the size
// asked, and the pool keeps at most kMaxKeptBytes.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "comm/scratch_pool.h"

namespace foldpar {
namespace {

TEST(ScratchPool, ABufferGivenBackIsTakenAgainForTheSameSize) {
  const size_t bytes = (size_t{3} << 20) + 100;  // over 2 MiB: rounded to 4 MiB
  std::byte* first = nullptr;
  {
    ScratchBuffer b = ScratchBuffer::take(bytes);
    ASSERT_NE(b.data(), nullptr);
    EXPECT_GE(b.capacity(), bytes);
    EXPECT_EQ(b.capacity(), size_t{4} << 20);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
    std::memset(b.data(), 1, bytes);
    first = b.data();
  }
  const size_t kept = ScratchBuffer::kept_bytes();
  EXPECT_GE(kept, bytes);
  ScratchBuffer again = ScratchBuffer::take(bytes);
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(ScratchBuffer::kept_bytes(), kept - again.capacity());
  ScratchBuffer other = ScratchBuffer::take(bytes);  // the first is taken: a new one
  EXPECT_NE(other.data(), first);
}

TEST(ScratchPool, NeverHandsOutABufferMoreThanTwiceTheSize) {
  std::byte* big = nullptr;
  {
    ScratchBuffer b = ScratchBuffer::take(size_t{16} << 20);
    big = b.data();
  }
  ScratchBuffer small = ScratchBuffer::take(size_t{1} << 20);
  EXPECT_NE(small.data(), big);
  EXPECT_GE(small.capacity(), size_t{1} << 20);
  EXPECT_LE(small.capacity(), size_t{2} << 20);
  ScratchBuffer nine = ScratchBuffer::take(size_t{9} << 20);  // 16 <= 2 x 9: the big one
  EXPECT_EQ(nine.data(), big);
}

TEST(ScratchPool, MoveHandsOverAndAssignmentGivesTheOldBufferBack) {
  ScratchBuffer a = ScratchBuffer::take(4096);
  std::byte* p = a.data();
  ScratchBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.data(), p);
  const size_t kept = ScratchBuffer::kept_bytes();
  b = ScratchBuffer::take(8192);
  EXPECT_NE(b.data(), p);
  EXPECT_EQ(ScratchBuffer::kept_bytes(), kept + 4096);  // the 4 KiB one went back
  EXPECT_EQ(ScratchBuffer::take(0).data(), nullptr);
}

TEST(ScratchPool, KeepsAtMostItsBound) {
  {
    std::vector<ScratchBuffer> held;
    for (int i = 0; i < 5; ++i) held.push_back(ScratchBuffer::take(ScratchBuffer::kMaxKeptBytes / 4));
  }
  EXPECT_LE(ScratchBuffer::kept_bytes(), ScratchBuffer::kMaxKeptBytes);
}

}  // namespace
}  // namespace foldpar
