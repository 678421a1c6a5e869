// BlockPool (tensor/block_pool.h), the caching pool of the CUDA device memory, over malloc
// with a byte budget standing in for the GPU's free memory: size classes, reuse of released
// blocks, the cache emptied back into the source when it refuses, and a refusal that stays.
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>

#include "tensor/block_pool.h"

namespace foldpar {
namespace {

// malloc with a limit: refuses a block that would take it past `budget` bytes.
struct BudgetSource {
  size_t budget = 0;
  size_t used = 0;
  int64_t allocations = 0, releases = 0;
  std::set<size_t>* sizes_seen = nullptr;
  void* allocate(size_t bytes) {
    if (sizes_seen != nullptr) sizes_seen->insert(bytes);
    if (used + bytes > budget) return nullptr;
    used += bytes;
    ++allocations;
    return std::malloc(bytes);
  }
  void release(void* p, size_t bytes) {
    used -= bytes;
    ++releases;
    std::free(p);
  }
};

using Pool = BlockPool<BudgetSource>;

TEST(BlockPool, SizeClassesRoundUp) {
  EXPECT_EQ(Pool::size_class(0), 512u);
  EXPECT_EQ(Pool::size_class(1), 512u);
  EXPECT_EQ(Pool::size_class(512), 512u);
  EXPECT_EQ(Pool::size_class(513), 1024u);
  EXPECT_EQ(Pool::size_class((1 << 20) - 1), size_t{1} << 20);
  EXPECT_EQ(Pool::size_class((1 << 20) + 1), size_t{2} << 20);
}

TEST(BlockPool, ReleasedBlocksServeTheSameClassAgain) {
  std::set<size_t> seen;
  Pool pool(BudgetSource{.budget = size_t{64} << 20, .sizes_seen = &seen});
  void* a = pool.allocate(1000);
  void* b = pool.allocate(3 << 20);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(pool.stats().in_use_bytes, 1024 + (3 << 20));
  pool.release(a, 1000);
  pool.release(b, 3 << 20);
  EXPECT_EQ(pool.stats().cached_bytes, 1024 + (3 << 20));
  EXPECT_EQ(pool.allocate(1001), a);       // same class (1024): the cached block
  EXPECT_EQ(pool.allocate((3 << 20) - 5), b);
  EXPECT_EQ(pool.stats().hits, 2);
  EXPECT_EQ(pool.source().allocations, 2);  // nothing new from the source
  void* c = pool.allocate(1000);            // the class's cache is empty: a new block
  EXPECT_NE(c, a);
  EXPECT_EQ(pool.source().allocations, 3);
  EXPECT_EQ(seen, (std::set<size_t>{1024, size_t{3} << 20}));  // the source only sees classes
  pool.release(a, 1001);
  pool.release(b, (3 << 20) - 5);
  pool.release(c, 1000);
  EXPECT_EQ(pool.stats().in_use_bytes, 0);
  EXPECT_EQ(pool.stats().reserved_bytes, pool.stats().cached_bytes);
}

TEST(BlockPool, RefusalEmptiesTheCacheAndRetries) {
  Pool pool(BudgetSource{.budget = size_t{8} << 20});
  void* a = pool.allocate(size_t{3} << 20);
  void* b = pool.allocate(size_t{3} << 20);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  pool.release(a, size_t{3} << 20);
  pool.release(b, size_t{3} << 20);
  // 6 MiB cached of an 8 MiB budget: a 5 MiB block fits only once the cache goes back.
  void* c = pool.allocate(size_t{5} << 20);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(pool.stats().source_failures, 1);
  EXPECT_EQ(pool.stats().trims, 1);
  EXPECT_EQ(pool.stats().cached_bytes, 0);
  EXPECT_EQ(pool.stats().reserved_bytes, int64_t{5} << 20);
  EXPECT_EQ(pool.source().releases, 2);
  // Beyond the budget with nothing cached: nullptr, counted, and the pool still works.
  EXPECT_EQ(pool.allocate(size_t{4} << 20), nullptr);
  EXPECT_EQ(pool.stats().source_failures, 2);
  pool.release(c, size_t{5} << 20);
  EXPECT_NE(pool.allocate(size_t{5} << 20), nullptr);
  EXPECT_EQ(pool.stats().peak_reserved_bytes, int64_t{6} << 20);
}

TEST(BlockPool, TrimReturnsEverythingCached) {
  Pool pool(BudgetSource{.budget = size_t{16} << 20});
  std::vector<void*> blocks;
  for (int i = 0; i < 5; ++i) blocks.push_back(pool.allocate(static_cast<size_t>(700 * (i + 1))));
  for (int i = 0; i < 5; ++i) pool.release(blocks[i], static_cast<size_t>(700 * (i + 1)));
  pool.trim();
  EXPECT_EQ(pool.source().used, 0u);
  EXPECT_EQ(pool.stats().reserved_bytes, 0);
}

}  // namespace
}  // namespace foldpar
