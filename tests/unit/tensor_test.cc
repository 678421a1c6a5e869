// Tensor storage, views, dtype conversion, and the tracked allocator's exact counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "tensor/compare.h"
#include "tensor/tensor.h"

namespace foldpar {
namespace {

TEST(MemoryTracker, CountsEveryCategoryExactly) {
  MemoryTracker tracker;
  {
    Tensor p = Tensor::empty({3, 5}, DType::kF32, MemCategory::kParameters, tracker);       // 60
    Tensor g = Tensor::empty({7}, DType::kF64, MemCategory::kGradients, tracker);           // 56
    Tensor o = Tensor::empty({2, 2, 2}, DType::kBF16, MemCategory::kOptimizer, tracker);    // 16
    Tensor a = Tensor::empty({11}, DType::kI32, MemCategory::kActivations, tracker);        // 44
    Tensor c = Tensor::empty({1}, DType::kI64, MemCategory::kComm, tracker);                // 8
    Tensor w = Tensor::empty({0, 4}, DType::kF32, MemCategory::kWorkspace, tracker);        // 0
    MemoryStats s = tracker.stats();
    EXPECT_EQ(s.current_of(MemCategory::kParameters), 60);
    EXPECT_EQ(s.current_of(MemCategory::kGradients), 56);
    EXPECT_EQ(s.current_of(MemCategory::kOptimizer), 16);
    EXPECT_EQ(s.current_of(MemCategory::kActivations), 44);
    EXPECT_EQ(s.current_of(MemCategory::kComm), 8);
    EXPECT_EQ(s.current_of(MemCategory::kWorkspace), 0);
    EXPECT_EQ(s.current_total, 60 + 56 + 16 + 44 + 8);
    EXPECT_EQ(s.peak_total, 60 + 56 + 16 + 44 + 8);
    EXPECT_EQ(s.live_allocations, 6);

    // Views count nothing; the storage lives while any view does.
    Tensor v = p.narrow(1, 3).reshape({10});
    EXPECT_EQ(tracker.stats().current_total, 184);
    p = Tensor();
    EXPECT_EQ(tracker.stats().current_of(MemCategory::kParameters), 60);
  }
  MemoryStats s = tracker.stats();
  EXPECT_EQ(s.current_total, 0);
  EXPECT_EQ(s.live_allocations, 0);
  EXPECT_EQ(s.peak_total, 184);
  EXPECT_EQ(s.peak_of(MemCategory::kParameters), 60);
  EXPECT_EQ(s.total_allocations, 6);
}

TEST(MemoryTracker, PeakIsOfTheSumNotSumOfPeaks) {
  MemoryTracker tracker;
  { Tensor a = Tensor::empty({100}, DType::kF32, MemCategory::kActivations, tracker); }
  { Tensor b = Tensor::empty({50}, DType::kF32, MemCategory::kWorkspace, tracker); }
  MemoryStats s = tracker.stats();
  EXPECT_EQ(s.peak_of(MemCategory::kActivations), 400);
  EXPECT_EQ(s.peak_of(MemCategory::kWorkspace), 200);
  EXPECT_EQ(s.peak_total, 400);
  Tensor keep = Tensor::empty({10}, DType::kF32, MemCategory::kWorkspace, tracker);
  tracker.reset_peaks();
  s = tracker.stats();
  EXPECT_EQ(s.peak_total, 40);
  EXPECT_EQ(s.peak_of(MemCategory::kActivations), 0);
  EXPECT_EQ(s.peak_of(MemCategory::kWorkspace), 40);
}

TEST(MemoryTracker, CacheReusesBlocksWithoutCountingThem) {
  MemoryTracker tracker;
  tracker.set_caching(true);
  const int64_t n = MemoryTracker::kCacheMinBytes;  // floats: 4x the cache threshold
  void* first = nullptr;
  {
    Tensor a = Tensor::empty({n}, DType::kF32, MemCategory::kActivations, tracker);
    first = a.raw_data();
  }
  MemoryStats s = tracker.stats();
  EXPECT_EQ(s.current_total, 0);
  EXPECT_EQ(s.cached_bytes, n * 4);
  Tensor b = Tensor::empty({n}, DType::kF32, MemCategory::kGradients, tracker);
  EXPECT_EQ(b.raw_data(), first);
  s = tracker.stats();
  EXPECT_EQ(s.cache_hits, 1);
  EXPECT_EQ(s.cached_bytes, 0);
  EXPECT_EQ(s.current_of(MemCategory::kGradients), n * 4);
  EXPECT_EQ(s.current_of(MemCategory::kActivations), 0);
  { Tensor small = Tensor::empty({10}, DType::kF32, MemCategory::kWorkspace, tracker); }
  EXPECT_EQ(tracker.stats().cached_bytes, 0);  // small blocks are not cached
  b = Tensor();
  tracker.set_caching(false);
  EXPECT_EQ(tracker.stats().cached_bytes, 0);
}

// Sizes that vary from step to step (a MoE expert's rows, a prompt's length) share blocks:
// a block serves every request of its size class, at most 1/8 above the request.
TEST(MemoryTracker, BlocksComeInGeometricSizeClasses) {
  EXPECT_EQ(MemoryTracker::block_size(100), 128u);  // below the cache: 64-byte aligned
  EXPECT_EQ(MemoryTracker::block_size(64 << 10), size_t{64} << 10);
  EXPECT_EQ(MemoryTracker::block_size((64 << 10) + 1), size_t{72} << 10);  // classes of 8 KiB
  EXPECT_EQ(MemoryTracker::block_size((1 << 20) + 1), size_t{9} << 17);   // of 128 KiB
  for (size_t b : {size_t{65536}, size_t{100000}, size_t{3} << 20, (size_t{6} << 20) + 12345, size_t{1} << 33}) {
    const size_t c = MemoryTracker::block_size(b);
    EXPECT_GE(c, b);
    EXPECT_LE(c, b + b / 8) << b;
    EXPECT_EQ(c % 4096, 0u) << b;
    EXPECT_EQ(MemoryTracker::block_size(c), c) << b;  // a class is its own class
  }
  MemoryTracker tracker;
  tracker.set_caching(true);
  void* first = tracker.allocate(1000000, MemCategory::kActivations);
  tracker.release(first, 1000000, MemCategory::kActivations);
  void* second = tracker.allocate(1040000, MemCategory::kActivations);  // the same class
  EXPECT_EQ(second, first);
  EXPECT_EQ(tracker.stats().cache_hits, 1);
  EXPECT_EQ(tracker.stats().current_total, 1040000);  // counted as requested, not as the block
  tracker.release(second, 1040000, MemCategory::kActivations);
  tracker.release_cache();
}

// The cache holds at most twice the most bytes of blocks ever live at once; beyond that the
// least recently released blocks go back to the system. Without the bound, sizes that change
// every step (MoE routing) kept every block ever made: a small MoE model's training grew by
// 45 MB a step.
TEST(MemoryTracker, CacheIsBoundedByTheHighWaterOfLiveBlocks) {
  MemoryTracker tracker;
  tracker.set_caching(true);
  const size_t mib = size_t{1} << 20;
  const size_t sizes[] = {mib, mib + mib / 8, mib + mib / 4};  // three size classes
  void* blocks[3];
  for (int i = 0; i < 3; ++i) {  // one live at a time: the high water is the largest
    blocks[i] = tracker.allocate(sizes[i], MemCategory::kActivations);
    tracker.release(blocks[i], sizes[i], MemCategory::kActivations);
  }
  // 3.375 MiB released against a bound of 2 x 1.25 MiB: the oldest, 1 MiB, went back.
  MemoryStats s = tracker.stats();
  EXPECT_EQ(s.cache_hits, 0);
  EXPECT_EQ(s.cache_evictions, 1);
  EXPECT_EQ(s.cached_bytes, static_cast<int64_t>(sizes[1] + sizes[2]));
  void* again[3];
  for (int i : {2, 1, 0}) again[i] = tracker.allocate(sizes[i], MemCategory::kActivations);
  EXPECT_EQ(again[2], blocks[2]);
  EXPECT_EQ(again[1], blocks[1]);
  EXPECT_EQ(tracker.stats().cache_hits, 2);  // the evicted class was a miss
  for (int i = 0; i < 3; ++i) tracker.release(again[i], sizes[i], MemCategory::kActivations);
  // The most recently released block of a class is handed out first.
  void* c = tracker.allocate(2 * mib, MemCategory::kActivations);
  void* d = tracker.allocate(2 * mib, MemCategory::kActivations);
  tracker.release(c, 2 * mib, MemCategory::kActivations);
  tracker.release(d, 2 * mib, MemCategory::kActivations);
  void* e = tracker.allocate(2 * mib, MemCategory::kActivations);
  EXPECT_EQ(e, d);
  tracker.release(e, 2 * mib, MemCategory::kActivations);
  // Steps whose sizes all differ: the cache never holds more than twice what was live at once.
  int64_t most_live = 4 * static_cast<int64_t>(mib);  // the two 2 MiB blocks above
  for (int step = 0; step < 50; ++step) {
    std::vector<std::pair<void*, size_t>> live;
    int64_t now = 0;
    for (int i = 0; i < 6; ++i) {
      const size_t bytes = mib / 2 + static_cast<size_t>((step * 7919 + i * 104729) % 4096) * 1024;
      live.emplace_back(tracker.allocate(bytes, MemCategory::kActivations), bytes);
      now += static_cast<int64_t>(MemoryTracker::block_size(bytes));
    }
    most_live = std::max(most_live, now);
    for (auto [p, bytes] : live) tracker.release(p, bytes, MemCategory::kActivations);
    EXPECT_LE(tracker.stats().cached_bytes, MemoryTracker::kCacheBoundFactor * most_live) << step;
  }
  EXPECT_GT(tracker.stats().cache_evictions, 1);
  tracker.release_cache();
  EXPECT_EQ(tracker.stats().cached_bytes, 0);
}

TEST(MemoryTracker, HugeOrOverflowingSizesFailCleanly) {
  MemoryTracker tracker;
  Result<Tensor> t = Tensor::try_empty({int64_t{1} << 40, int64_t{1} << 30}, DType::kF32, MemCategory::kWorkspace, tracker);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(tracker.allocate(~size_t{0} - 10, MemCategory::kWorkspace), nullptr);
  EXPECT_EQ(tracker.stats().current_total, 0);
}

TEST(MemoryTracker, StorageIsAligned) {
  MemoryTracker tracker;
  for (int n : {1, 3, 17, 1000}) {
    Tensor t = Tensor::empty({n}, DType::kBF16, MemCategory::kWorkspace, tracker);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % MemoryTracker::kAlignment, 0u);
  }
}

TEST(Tensor, NarrowAndReshapeAreViews) {
  MemoryTracker tracker;
  Tensor t = Tensor::empty({4, 3}, DType::kF32, MemCategory::kWorkspace, tracker);
  for (int i = 0; i < 12; ++i) t.data<float>()[i] = static_cast<float>(i);
  Tensor rows = t.narrow(1, 3);
  EXPECT_EQ(rows.shape(), (Shape{2, 3}));
  EXPECT_EQ(rows.data<float>()[0], 3.0f);
  EXPECT_TRUE(rows.shares_storage_with(t));
  rows.data<float>()[0] = -1;
  EXPECT_EQ(t.data<float>()[3], -1.0f);
  Tensor flat = t.reshape({12});
  EXPECT_EQ(flat.data<float>()[11], 11.0f);
  Tensor c = t.clone(MemCategory::kWorkspace);
  EXPECT_FALSE(c.shares_storage_with(t));
  EXPECT_EQ(max_rel_error(c, t), 0.0);
}

TEST(Tensor, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly half way between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 0x1p-8f)), 1.0f);
  // 1 + 3*2^-8 is half way between 1+2^-7 (odd mantissa) and 1+2^-6: rounds up to even.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f)), 1.0f + 0x1p-7f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::infinity())), std::numeric_limits<float>::infinity());
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(-2.5f)), -2.5f);
}

TEST(Tensor, ConversionRoundTrip) {
  MemoryTracker tracker;
  Tensor t = Tensor::empty({5}, DType::kF32, MemCategory::kWorkspace, tracker);
  const float vals[] = {0.1f, -3.0f, 1e-3f, 65504.0f, 0.0f};
  std::copy(vals, vals + 5, t.data<float>());
  Tensor b = t.to(DType::kBF16, MemCategory::kWorkspace);
  EXPECT_EQ(b.nbytes(), 10u);
  Tensor back = b.to(DType::kF32, MemCategory::kWorkspace);
  // bf16 keeps 8 significant bits: relative error at most 2^-9.
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(back.data<float>()[i], vals[i], std::abs(vals[i]) * 0x1p-9);
  Tensor d = t.to(DType::kF64, MemCategory::kWorkspace);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(d.data<double>()[i], static_cast<double>(vals[i]));
}

TEST(Compare, RelativeErrorIsNormwise) {
  MemoryTracker tracker;
  Tensor a = Tensor::zeros({3}, DType::kF32, MemCategory::kWorkspace, tracker);
  Tensor b = Tensor::zeros({3}, DType::kF64, MemCategory::kWorkspace, tracker);
  b.data<double>()[0] = 2.0;
  a.data<float>()[0] = 2.0f;
  a.data<float>()[2] = 0.01f;  // an error of 0.01 against a reference of scale 2
  EXPECT_DOUBLE_EQ(max_rel_error(a, b), static_cast<double>(0.01f) / 2.0);
  EXPECT_NE(describe_mismatches(a, b, 1e-3).find("[2]"), std::string::npos);
  a.data<float>()[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isinf(max_rel_error(a, b)));
  // An infinite reference entry does not inflate the scale: it must be matched exactly.
  a.data<float>()[1] = 0.0f;
  b.data<double>()[1] = -std::numeric_limits<double>::infinity();
  EXPECT_TRUE(std::isinf(max_rel_error(a, b)));
  a.data<float>()[1] = -std::numeric_limits<float>::infinity();
  EXPECT_DOUBLE_EQ(max_rel_error(a, b), static_cast<double>(0.01f) / 2.0);
}

}  // namespace
}  // namespace foldpar
