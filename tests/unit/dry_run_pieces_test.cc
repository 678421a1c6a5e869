// The pieces of the dry run (docs/design.md, Planning / dry run): storage-less tensors count
// exactly as real ones and fail on host access; the meta backend rejects what the real
// backends reject and counts FLOPs as model/flop_count.h; counting communicators count as
// comm_stats.h and record starts and completions in program order; the counting mesh has
// the ranks of Mesh's documented order, at 1024 ranks too.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "backend/meta/meta_backend.h"
#include "comm/counting_communicator.h"
#include "model/flop_count.h"
#include "tensor/storageless_allocator.h"

namespace foldpar {
namespace {

// ---- storage-less tensors ----

void allocate_sequence(MemoryTracker& mt) {
  std::vector<Tensor> live;
  live.push_back(Tensor::empty({3, 5}, DType::kF32, MemCategory::kParameters, mt));
  live.push_back(Tensor::empty({1024, 1024}, DType::kBF16, MemCategory::kActivations, mt));
  { Tensor t = Tensor::empty({70000}, DType::kF64, MemCategory::kWorkspace, mt); }
  live.push_back(Tensor::zeros({7}, DType::kI32, MemCategory::kComm, mt));
  Tensor view = live[1].narrow(10, 20);  // counts nothing
  live.erase(live.begin());
  live.push_back(Tensor::empty({70000}, DType::kF64, MemCategory::kWorkspace, mt));  // from the cache
}

TEST(StoragelessTensor, CountsExactlyAsRealAllocation) {
  MemoryTracker real;
  std::unique_ptr<MemoryTracker> meta = MemoryTracker::make_storageless();
  ASSERT_TRUE(meta->storageless());
  allocate_sequence(real);
  allocate_sequence(*meta);
  const MemoryStats a = real.stats(), b = meta->stats();
  EXPECT_EQ(a.current, b.current);
  EXPECT_EQ(a.peak, b.peak);
  EXPECT_EQ(a.peak_total, b.peak_total);
  EXPECT_EQ(a.total_allocations, b.total_allocations);
  EXPECT_EQ(a.cache_hits, b.cache_hits);
  EXPECT_EQ(a.cached_bytes, b.cached_bytes);
  EXPECT_GT(b.peak_of(MemCategory::kActivations), 0);
}

TEST(StoragelessTensor, AddressesAreDistinctAndDoNotOverlap) {
  std::unique_ptr<MemoryTracker> meta = MemoryTracker::make_storageless();
  std::vector<Tensor> ts;
  for (int i = 1; i <= 50; ++i) ts.push_back(Tensor::empty({i * 37}, DType::kF32, MemCategory::kWorkspace, *meta));
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_FALSE(ts[i].has_storage());
    const char* a = static_cast<const char*>(ts[i].raw_data());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % MemoryTracker::kAlignment, 0u);
    for (size_t j = i + 1; j < ts.size(); ++j) {
      const char* b = static_cast<const char*>(ts[j].raw_data());
      EXPECT_TRUE(a + ts[i].nbytes() <= b || b + ts[j].nbytes() <= a) << i << " and " << j << " overlap";
    }
  }
}

TEST(StoragelessTensor, TensorsMadeBeforeAreUnaffected) {
  Tensor host = Tensor::zeros({4}, DType::kF32, MemCategory::kWorkspace);
  std::unique_ptr<MemoryTracker> meta = MemoryTracker::make_storageless();
  {
    ScopedDefaultTracker scope(*meta);
    Tensor t = Tensor::empty({4}, DType::kF32, MemCategory::kWorkspace);  // the scope's tracker
    EXPECT_FALSE(t.has_storage());
    EXPECT_EQ(meta->stats().current_total, 16);
    host.data<float>()[2] = 5;  // a real tensor stays real inside the scope
  }
  EXPECT_EQ(host.data<float>()[2], 5);
  EXPECT_TRUE(Tensor::empty({1}, DType::kF32, MemCategory::kWorkspace).has_storage());
}

TEST(StoragelessTensor, ReservationsAreReleased) {
  // 64 trackers of 4 TiB each would exceed the 128 TiB user address space if kept.
  for (int i = 0; i < 64; ++i) {
    std::unique_ptr<MemoryTracker> meta = MemoryTracker::make_storageless();
    Tensor t = Tensor::empty({size_t{1} << 28}, DType::kF32, MemCategory::kActivations, *meta);  // 1 GiB
    EXPECT_EQ(meta->stats().current_total, int64_t{1} << 30);
  }
}

TEST(StoragelessAllocatorTest, FreedRangesAreReusedAndCoalesced) {
  StoragelessAllocator a(size_t{1} << 20);  // 1 MiB
  void* x = a.allocate(256 * 1024);
  void* y = a.allocate(256 * 1024);
  void* z = a.allocate(512 * 1024);
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(a.allocate(64), nullptr);  // full
  a.release(x, 256 * 1024);
  a.release(y, 256 * 1024);  // coalesces with x
  void* w = a.allocate(512 * 1024);
  EXPECT_EQ(w, x);
  EXPECT_TRUE(a.contains(w));
}

TEST(StoragelessTensorDeathTest, DataFailsNamingTheTensor) {
  std::unique_ptr<MemoryTracker> meta = MemoryTracker::make_storageless();
  Tensor t = Tensor::empty({2, 3}, DType::kF32, MemCategory::kActivations, *meta);
  EXPECT_DEATH(t.data<float>(), "host access to F32\\[2, 3\\] activations, which has no storage \\(dry run\\)");
  EXPECT_DEATH(t.zero(), "host access to F32\\[2, 3\\] activations");
  EXPECT_DEATH(t.clone(MemCategory::kWorkspace), "which has no storage");
}

TEST(StoragelessTensorDeathTest, RawDereferenceFaultsWithAMessage) {
  std::unique_ptr<MemoryTracker> meta = MemoryTracker::make_storageless();
  Tensor t = Tensor::empty({8}, DType::kF32, MemCategory::kComm, *meta);
  install_storageless_fault_handler();
  volatile float* p = static_cast<float*>(t.raw_data());
  EXPECT_DEATH(p[3] = 1.0f, "host access to address 0x[0-9a-f]+ inside a storage-less block \\(dry run\\)");
}

// ---- the meta backend ----

Tensor meta_tensor(MemoryTracker& mt, const Shape& s, DType d = DType::kF32) {
  return Tensor::empty(s, d, MemCategory::kWorkspace, mt);
}

TEST(MetaBackendTest, MatmulRecordsShapeFlopsAndBytes) {
  std::unique_ptr<MemoryTracker> mt = MemoryTracker::make_storageless();
  EventOrder order;
  MetaBackend be(MetaBackendOptions{.order = &order});
  Tensor a = meta_tensor(*mt, {2, 6, 8}), b = meta_tensor(*mt, {5, 8}), c = meta_tensor(*mt, {12, 5});
  be.matmul(a, false, b, true, c);
  order.next();  // another recorder's event in between
  be.matmul(a, false, b, true, c, 1.0f, 1.0f);
  ASSERT_EQ(be.records().size(), 2u);
  const OpRecord& r = be.records()[0];
  EXPECT_EQ(r.op, "matmul");
  EXPECT_EQ(r.shape.kind, OpShape::Kind::kMatmul);
  EXPECT_EQ(r.shape.m, 12);
  EXPECT_EQ(r.shape.n, 5);
  EXPECT_EQ(r.shape.k, 8);
  EXPECT_EQ(r.flops, 2.0 * 12 * 5 * 8);
  EXPECT_EQ(r.bytes_read, (96 + 40) * 4);
  EXPECT_EQ(r.bytes_written, 60 * 4);
  EXPECT_EQ(r.seq, 1u);
  EXPECT_EQ(be.records()[1].seq, 3u);
  EXPECT_EQ(be.records()[1].bytes_read, (96 + 40 + 60) * 4);  // beta != 0 reads c
}

TEST(MetaBackendTest, AttentionFlopsAreFlopCountsForCausalPositions) {
  LlamaConfig c;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.num_hidden_layers = 1;
  const int64_t B = 2, S = 48, d = c.head_dim();
  std::unique_ptr<MemoryTracker> mt = MemoryTracker::make_storageless();
  Tensor q = meta_tensor(*mt, {B, S, 4, d}), k = meta_tensor(*mt, {B, S, 2, d}), v = meta_tensor(*mt, {B, S, 2, d});
  Tensor out = meta_tensor(*mt, {B, S, 4, d}), lse = meta_tensor(*mt, {B, 4, S});
  Tensor dq = meta_tensor(*mt, {B, S, 4, d}), dk = meta_tensor(*mt, {B, S, 2, d}), dv = meta_tensor(*mt, {B, S, 2, d});
  Tensor pos = Tensor::empty({S}, DType::kI32, MemCategory::kWorkspace);  // host positions 0..S-1
  std::iota(pos.data<int32_t>(), pos.data<int32_t>() + S, 0);
  MetaBackend be;
  const AttentionArgs args{&q, &k, &v, &pos, &pos, 0.125};
  be.attention_forward(args, out, lse);
  be.attention_backward(args, out, lse, out, dq, dk, dv);
  ASSERT_EQ(be.records().size(), 2u);
  EXPECT_TRUE(be.records()[0].pairs_exact);
  EXPECT_DOUBLE_EQ(be.records()[0].flops, forward_attention_flops(c, B, S));
  EXPECT_DOUBLE_EQ(be.records()[1].flops, 2 * forward_attention_flops(c, B, S));
  EXPECT_EQ(be.records()[0].shape.sq, S);
  EXPECT_EQ(be.records()[0].shape.n_kv, 2);
  // Positions without storage: every pair, and says so.
  Tensor meta_pos = meta_tensor(*mt, {S}, DType::kI32);
  be.attention_forward(AttentionArgs{&q, &k, &v, &meta_pos, &meta_pos, 0.125}, out, lse);
  EXPECT_FALSE(be.records()[2].pairs_exact);
  EXPECT_DOUBLE_EQ(be.records()[2].flops, 4.0 * d * 4 * S * S * B);
  // A sliding window (issue 21): the pairs the meta backend counts on the positions are the
  // ones the FLOP count derives in closed form, windows under, at and above S. Hand-counted
  // at W = 5: 1 + 2 + 3 + 4 + 5 * (S - 4) keys.
  for (const int64_t window : {1, 5, 47, 48, 100}) {
    c.sliding_window = window;
    const AttentionArgs windowed{&q, &k, &v, &pos, &pos, 0.125, window};
    be.attention_forward(windowed, out, lse);
    EXPECT_DOUBLE_EQ(be.records().back().flops, forward_attention_flops(c, B, S)) << "window " << window;
  }
  c.sliding_window = 5;
  EXPECT_DOUBLE_EQ(forward_attention_flops(c, B, S), 4.0 * d * 4 * (10 + 5 * (S - 4)) * B);
}

// The counted pairs against a count over every (query, key) pair, for positions in the
// orders the strategies produce (zigzag chunks gathered rank by rank, a decode step's
// single query) and for keys spread far wider than their number (the sorting fallback),
// windows off and on.
TEST(MetaBackendTest, AttentionPairsMatchABruteForceCount) {
  const int64_t d = 8;
  auto brute = [](const std::vector<int32_t>& q, const std::vector<int32_t>& k, int64_t window) {
    int64_t n = 0;
    for (int32_t qi : q)
      for (int32_t kj : k) n += kj <= qi && (window <= 0 || qi - kj < window);
    return n;
  };
  std::vector<int32_t> zigzag;  // 4 ranks, 8 chunks of 6: rank r holds chunks r and 7 - r
  for (int r = 0; r < 4; ++r)
    for (int c : {r, 7 - r})
      for (int i = 0; i < 6; ++i) zigzag.push_back(c * 6 + i);
  std::vector<int32_t> wide;  // 40 keys over a range of about 10^6: sorted, not counted
  for (int i = 0; i < 40; ++i) wide.push_back((i * 7919 * 31) % 1000003);
  const std::vector<int32_t> own_q(zigzag.begin() + 12, zigzag.begin() + 24);  // rank 1's queries
  const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> cases = {
      {own_q, zigzag}, {{47}, zigzag}, {{0, 3, 500000, 999999}, wide}, {wide, wide}, {{-3, 2}, {-5, -4, 0, 2, 9}}};
  std::unique_ptr<MemoryTracker> mt = MemoryTracker::make_storageless();
  MetaBackend be;
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const auto& [qv, kv] = cases[ci];
    const int64_t sq = static_cast<int64_t>(qv.size()), sk = static_cast<int64_t>(kv.size());
    Tensor q = meta_tensor(*mt, {1, sq, 1, d}), k = meta_tensor(*mt, {1, sk, 1, d}), v = meta_tensor(*mt, {1, sk, 1, d});
    Tensor out = meta_tensor(*mt, {1, sq, 1, d}), lse = meta_tensor(*mt, {1, 1, sq});
    Tensor qp = Tensor::empty({sq}, DType::kI32, MemCategory::kWorkspace);
    Tensor kp = Tensor::empty({sk}, DType::kI32, MemCategory::kWorkspace);
    std::copy(qv.begin(), qv.end(), qp.data<int32_t>());
    std::copy(kv.begin(), kv.end(), kp.data<int32_t>());
    for (const int64_t window : {0, 1, 7, 30, 1 << 20}) {
      be.attention_forward(AttentionArgs{&q, &k, &v, &qp, &kp, 0.125, window}, out, lse);
      ASSERT_TRUE(be.records().back().pairs_exact);
      EXPECT_DOUBLE_EQ(be.records().back().flops, 4.0 * d * static_cast<double>(brute(qv, kv, window)))
          << "case " << ci << " window " << window;
    }
  }
}

// The meta backend takes the CPU flash attention's scratch for the call: same workspace peak.
TEST(MetaBackendTest, AttentionScratchPeaksAsTheCpuKernels) {
  const int64_t B = 1, Sq = 40, Sk = 300, d = 16;
  for (bool gqa : {false, true}) {
    const int64_t n_kv = gqa ? 2 : 4;
    auto peak_of = [&](Backend& be, MemoryTracker& mt) {
      ScopedDefaultTracker scope(mt);
      auto make = [&](const Shape& s) { return Tensor::zeros(s, DType::kF32, MemCategory::kActivations); };
      Tensor q = make({B, Sq, 4, d}), k = make({B, Sk, n_kv, d}), v = make({B, Sk, n_kv, d});
      Tensor out = make({B, Sq, 4, d}), lse = make({B, 4, Sq}), dq = make({B, Sq, 4, d});
      Tensor dk = make({B, Sk, n_kv, d}), dv = make({B, Sk, n_kv, d});
      Tensor qp = Tensor::empty({Sq}, DType::kI32, MemCategory::kActivations, MemoryTracker::process());
      Tensor kp = Tensor::empty({Sk}, DType::kI32, MemCategory::kActivations, MemoryTracker::process());
      std::iota(qp.data<int32_t>(), qp.data<int32_t>() + Sq, int32_t{Sk - Sq});
      std::iota(kp.data<int32_t>(), kp.data<int32_t>() + Sk, 0);
      const AttentionArgs args{&q, &k, &v, &qp, &kp, 0.25};
      mt.reset_peaks();
      be.attention_forward(args, out, lse);
      const int64_t fwd = mt.stats().peak_of(MemCategory::kWorkspace);
      mt.reset_peaks();
      be.attention_backward(args, out, lse, out, dq, dk, dv);
      return std::pair{fwd, mt.stats().peak_of(MemCategory::kWorkspace)};
    };
    MemoryTracker real;
    std::unique_ptr<MemoryTracker> meta_mt = MemoryTracker::make_storageless();
    std::unique_ptr<Backend> cpu = make_cpu_backend();
    MetaBackend meta;
    const auto expected = peak_of(*cpu, real);
    EXPECT_GT(expected.first, 0);
    EXPECT_EQ(peak_of(meta, *meta_mt), expected) << "gqa " << gqa;
  }
}

TEST(MetaBackendTest, ScalarOpsReturnZeroAndTokenwiseOpsRecordRows) {
  std::unique_ptr<MemoryTracker> mt = MemoryTracker::make_storageless();
  MetaBackend be(MetaBackendOptions{.matmul_takes_bf16 = true});
  EXPECT_TRUE(be.matmul_takes_bf16());
  Tensor x = meta_tensor(*mt, {3, 4, 16}), w = meta_tensor(*mt, {16}), y = meta_tensor(*mt, {3, 4, 16});
  Tensor rstd = meta_tensor(*mt, {12});
  EXPECT_EQ(be.sum_squares(x), 0.0);
  be.rmsnorm_forward(x, w, 1e-5, y, rstd);
  Tensor logits = meta_tensor(*mt, {12, 16}), tg = meta_tensor(*mt, {12}, DType::kI32), lse = meta_tensor(*mt, {12});
  EXPECT_EQ(be.cross_entropy_forward(logits, tg, -100, lse), 0.0);
  ASSERT_EQ(be.records().size(), 3u);
  EXPECT_EQ(be.records()[1].op, "rmsnorm_forward");
  EXPECT_EQ(be.records()[1].shape.rows, 12);
  EXPECT_EQ(be.records()[1].shape.width, 16);
  EXPECT_EQ(be.records()[1].bytes_written, (192 + 12) * 4);
}

// The routing a dry run assumes: balanced, each expert T*k/E rows (+-1), k distinct experts
// per token; under imbalance X expert 0 takes min(T, X*T*k/E) rows and the others share the
// rest (+-1), still k distinct per token.
TEST(PlannedMoeRoutingTest, BalancedOrExpertZeroAtTheFactor) {
  auto loads = [](int64_t T, int64_t k, int64_t E, double x) {
    const std::vector<int32_t> r = planned_moe_routing(T, k, E, x);
    EXPECT_EQ(static_cast<int64_t>(r.size()), T * k);
    std::vector<int64_t> n(static_cast<size_t>(E), 0);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> row(r.begin() + t * k, r.begin() + (t + 1) * k);
      std::sort(row.begin(), row.end());
      EXPECT_EQ(std::adjacent_find(row.begin(), row.end()), row.end()) << "token " << t << " repeats an expert";
      for (int32_t e : row) {
        EXPECT_GE(e, 0);
        EXPECT_LT(e, E);
        ++n[e];
      }
    }
    return n;
  };
  EXPECT_EQ(loads(256, 2, 4, 1.0), (std::vector<int64_t>{128, 128, 128, 128}));
  EXPECT_EQ(loads(10, 2, 8, 1.0), (std::vector<int64_t>{3, 3, 3, 3, 2, 2, 2, 2}));  // 20 slots over 8
  EXPECT_EQ(loads(4, 4, 4, 1.0), (std::vector<int64_t>{4, 4, 4, 4}));                 // k = E
  const std::vector<int64_t> skew = loads(300, 2, 4, 1.5);  // expert 0: 1.5 * 150 = 225
  EXPECT_EQ(skew[0], 225);
  for (int e = 1; e < 4; ++e) EXPECT_EQ(skew[e], 125) << e;  // (600 - 225) / 3
  EXPECT_EQ(loads(100, 2, 4, 9.0)[0], 100);  // at most one slot per token
  EXPECT_EQ(planned_moe_routing(8, 2, 4, 1.0), planned_moe_routing(8, 2, 4, 1.0));
}

// What the dry run knows of integer contents: an upload reads back, the routing reads back as
// planned_moe_routing, and a counting communicator's all_gather / all_to_all delivers what
// ranks holding the same would (DryRunOptions' symmetric assumption); anything else reads 0.
TEST(MetaBackendTest, KnownIntegersReadBackAndTravelAsFromIdenticalRanks) {
  std::unique_ptr<MemoryTracker> mt = MemoryTracker::make_storageless();
  EventOrder order;
  MetaBackend be(MetaBackendOptions{.order = &order});
  CommTrace trace;
  trace.on_exchange = [&be](const CommOp& op, int rank, int size) {
    be.deliver_collective(op.kind == CommOpKind::kAllToAll, op.send_buf, op.recv_buf, op.count * dtype_size(op.dtype),
                          rank, size);
  };
  CountingCommunicator comm(1, 2, "tsp", {0, 1}, order, trace);
  const std::vector<int64_t> counts{5, 6, 7, 8};  // blocks of 2 per rank
  Tensor send = meta_tensor(*mt, {4}, DType::kI64), recv = meta_tensor(*mt, {4}, DType::kI64);
  be.copy_from_host(std::as_bytes(std::span<const int64_t>(counts)), send);
  std::vector<int64_t> back(4, -1);
  be.copy_to_host(send, std::as_writable_bytes(std::span<int64_t>(back)));
  EXPECT_EQ(back, counts);
  be.copy_to_host(recv, std::as_writable_bytes(std::span<int64_t>(back)));
  EXPECT_EQ(back, (std::vector<int64_t>{0, 0, 0, 0})) << "unknown contents read 0";
  ASSERT_TRUE(comm.all_to_all(send.raw_data(), recv.raw_data(), 2, DType::kI64).ok());
  be.copy_to_host(recv, std::as_writable_bytes(std::span<int64_t>(back)));
  EXPECT_EQ(back, (std::vector<int64_t>{7, 8, 7, 8})) << "rank 1 gets every rank's block 1";
  Tensor logits = meta_tensor(*mt, {6, 4}), probs = meta_tensor(*mt, {6, 4}), w = meta_tensor(*mt, {6, 2});
  Tensor ids = meta_tensor(*mt, {6, 2}, DType::kI32), all = meta_tensor(*mt, {24}, DType::kI32);
  be.moe_route_forward(logits, true, probs, w, ids);
  std::vector<int32_t> got(12), want = planned_moe_routing(6, 2, 4, 1.0);
  be.copy_to_host(ids, std::as_writable_bytes(std::span<int32_t>(got)));
  EXPECT_EQ(got, want);
  ASSERT_TRUE(comm.all_gather(ids.raw_data(), all.raw_data(), 12, DType::kI32).ok());
  std::vector<int32_t> gathered(24);
  be.copy_to_host(all, std::as_writable_bytes(std::span<int32_t>(gathered)));
  want.insert(want.end(), want.begin(), want.end());
  EXPECT_EQ(gathered, want);
  Tensor unknown = meta_tensor(*mt, {4}, DType::kI64);
  be.copy(unknown, recv);  // a write of unknown contents forgets
  be.copy_to_host(recv, std::as_writable_bytes(std::span<int64_t>(back)));
  EXPECT_EQ(back, (std::vector<int64_t>{0, 0, 0, 0}));
}

// The same bad arguments kill the meta backend and the real ones.
TEST(MetaBackendDeathTest, RejectsWhatTheRealBackendsReject) {
  std::unique_ptr<MemoryTracker> mt = MemoryTracker::make_storageless();
  MetaBackend meta;
  std::unique_ptr<Backend> cpu = make_cpu_backend(), ref = make_reference_backend();
  Tensor ma = meta_tensor(*mt, {4, 8}), mb = meta_tensor(*mt, {7, 5}), mc = meta_tensor(*mt, {4, 5});
  Tensor a = Tensor::zeros({4, 8}, DType::kF32, MemCategory::kWorkspace);
  Tensor b = Tensor::zeros({7, 5}, DType::kF32, MemCategory::kWorkspace);
  Tensor c = Tensor::zeros({4, 5}, DType::kF32, MemCategory::kWorkspace);
  EXPECT_DEATH(meta.matmul(ma, false, mb, false, mc), "matmul \\[4, 8\\] x \\[7, 5\\]");
  EXPECT_DEATH(cpu->matmul(a, false, b, false, c), "matmul \\[4, 8\\] x \\[7, 5\\]");
  EXPECT_DEATH(ref->matmul(a, false, b, false, c), "matmul \\[4, 8\\] x \\[7, 5\\]");
  Tensor mx = meta_tensor(*mt, {4, 8}), mw = meta_tensor(*mt, {7}), mr = meta_tensor(*mt, {4});
  Tensor x = Tensor::zeros({4, 8}, DType::kF32, MemCategory::kWorkspace);
  Tensor w = Tensor::zeros({7}, DType::kF32, MemCategory::kWorkspace), r = Tensor::zeros({4}, DType::kF32, MemCategory::kWorkspace);
  EXPECT_DEATH(meta.rmsnorm_forward(mx, mw, 1e-5, mx, mr), "rmsnorm w");
  EXPECT_DEATH(cpu->rmsnorm_forward(x, w, 1e-5, x, r), "rmsnorm w");
  Tensor mbf = meta_tensor(*mt, {4, 8}, DType::kBF16), mbf2 = meta_tensor(*mt, {8, 5}, DType::kBF16);
  EXPECT_DEATH(meta.matmul(mbf, false, mbf2, false, mc), "matmul_takes_bf16 is off");
  Tensor mg = meta_tensor(*mt, {4, 8}), mu = meta_tensor(*mt, {4, 9});
  EXPECT_DEATH(meta.swiglu_forward(mg, mu, mg), "swiglu up");
  Tensor ids = meta_tensor(*mt, {3}, DType::kI32), table = meta_tensor(*mt, {10, 8});
  EXPECT_DEATH(meta.embedding_forward(ids, table, 0, mx), "embedding ids");
  // copy converts f32 <-> bf16 only (the bf16 storage decorator's widening), on every backend.
  Tensor m64 = meta_tensor(*mt, {4, 8}, DType::kF64), mi = meta_tensor(*mt, {4, 8}, DType::kI32);
  Tensor x64 = Tensor::zeros({4, 8}, DType::kF64, MemCategory::kWorkspace);
  Tensor x16 = Tensor::zeros({4, 8}, DType::kBF16, MemCategory::kWorkspace);
  EXPECT_DEATH(meta.copy(m64, mbf), "f32 <-> bf16");
  EXPECT_DEATH(meta.copy(mi, mx), "f32 <-> bf16");
  EXPECT_DEATH(cpu->copy(x64, x16), "f32 <-> bf16");
  EXPECT_DEATH(ref->copy(x64, x16), "f32 <-> bf16");
  meta.copy(mbf, mx);  // bf16 -> f32: accepted and recorded
  EXPECT_EQ(meta.records().back().op, "copy");
  EXPECT_EQ(meta.records().back().bytes_read, 4 * 8 * 2);
  EXPECT_EQ(meta.records().back().bytes_written, 4 * 8 * 4);
}

// ---- counting communicators and the counting mesh ----

TEST(CountingCommunicatorTest, CountsAsRingTrafficAndRecordsInProgramOrder) {
  EventOrder order;
  CommTrace trace;
  CountingCommunicator comm(1, 4, "tsp", {4, 5, 6, 7}, order, trace);
  std::vector<float> buf(64);
  ASSERT_TRUE(comm.all_gather(buf.data(), buf.data() + 16, 16, DType::kF32).ok());
  CommRequest r = comm.ibroadcast(buf.data(), 10, DType::kBF16, 2);
  order.next();  // a backend op in between
  ASSERT_TRUE(r.wait().ok());
  ASSERT_TRUE(comm.send_recv(buf.data(), buf.data() + 32, 8, DType::kF32, 2, 0).ok());
  ASSERT_TRUE(comm.all_reduce(buf.data(), buf.data(), 10, DType::kF32, ReduceOp::kSum).ok());

  // Hand-written from comm_stats.h's table, rank 1 of 4.
  EXPECT_EQ(comm.stats().op(CommOpKind::kAllGather), (OpCounters{1, 3 * 16 * 4, 3 * 16 * 4}));
  EXPECT_EQ(comm.stats().op(CommOpKind::kBroadcast), (OpCounters{1, 0, 10 * 2}));  // rank 1 is root-1: the chain ends here
  EXPECT_EQ(comm.stats().op(CommOpKind::kSendRecv), (OpCounters{1, 32, 32}));
  // all_reduce of 10 over 4: blocks 3,3,2,2; sent 2n - b[1] - b[2] = 15, received 2n - b[0] - b[1] = 14.
  EXPECT_EQ(comm.stats().op(CommOpKind::kAllReduce), (OpCounters{1, 15 * 4, 14 * 4}));

  ASSERT_EQ(trace.events.size(), 5u);
  EXPECT_EQ(trace.comms.at(0).world_ranks, (std::vector<int>{4, 5, 6, 7}));
  const CommEvent& bc = trace.events[1];
  EXPECT_EQ(bc.kind, CommOpKind::kBroadcast);
  EXPECT_FALSE(bc.blocking);
  EXPECT_EQ(bc.root, 2);
  EXPECT_EQ(bc.seq, 2u);
  const CommEvent& done = trace.events[2];
  EXPECT_EQ(done.type, CommEvent::Type::kComplete);
  EXPECT_EQ(done.request, bc.request);
  EXPECT_EQ(done.seq, 4u);  // after the op numbered 3 by someone else
  EXPECT_EQ(trace.events[3].peer, 2);
  EXPECT_EQ(trace.events[3].source, 0);
  EXPECT_EQ(trace.events[3].bytes_sent, 32u);
}

TEST(CountingCommunicatorDeathTest, KeepsTheContractChecks) {
  EventOrder order;
  CommTrace trace;
  CountingCommunicator comm(0, 4, "tp", {0, 1, 2, 3}, order, trace);
  std::vector<float> buf(64);
  EXPECT_DEATH((void)comm.all_gather(buf.data(), buf.data() + 1, 16, DType::kF32), "overlap");
  EXPECT_DEATH((void)comm.broadcast(buf.data(), 4, DType::kF32, 4), "root 4 is not a rank of 4 ranks");
}

TEST(CountingMeshTest, AxisRanksFollowTheMeshOrderAt1024Ranks) {
  const MeshLayout layout = MeshLayout::parse("dp=128,tsp=8").value();
  for (int p : {0, 7, 8, 517, 1023}) {
    EventOrder order;
    CommTrace trace;
    Result<CountingMesh> cm = make_counting_mesh(layout, p, order, trace);
    ASSERT_TRUE(cm.ok()) << cm.status().to_string();
    Mesh& mesh = *cm->mesh;
    EXPECT_EQ(mesh.coord("dp"), p / 8);
    EXPECT_EQ(mesh.coord("tsp"), p % 8);
    EXPECT_EQ(mesh.comm("tsp").rank(), p % 8);
    EXPECT_EQ(mesh.comm("dp").size(), 128);
    for (int j = 0; j < 8; ++j) EXPECT_EQ(mesh.comm("tsp").world_ranks()[j], 8 * (p / 8) + j);
    for (int i = 0; i < 128; ++i) EXPECT_EQ(mesh.comm("dp").world_ranks()[i], p % 8 + 8 * i);
  }
}

TEST(CountingMeshTest, ThreeAxesAsTheDocumentedExample) {
  // comm/mesh.h: for "dp=2,tp=2,sp=2", world rank 6 = 1*4 + 1*2 + 0 is dp 1, tp 1, sp 0.
  EventOrder order;
  CommTrace trace;
  Result<CountingMesh> cm = make_counting_mesh(MeshLayout::parse("dp=2,tp=2,sp=2").value(), 6, order, trace);
  ASSERT_TRUE(cm.ok());
  EXPECT_EQ(cm->mesh->coord("dp"), 1);
  EXPECT_EQ(cm->mesh->coord("tp"), 1);
  EXPECT_EQ(cm->mesh->coord("sp"), 0);
  EXPECT_EQ(cm->mesh->comm("dp").world_ranks(), (std::vector<int>{2, 6}));
  EXPECT_EQ(cm->mesh->comm("tp").world_ranks(), (std::vector<int>{4, 6}));
  EXPECT_EQ(cm->mesh->comm("sp").world_ranks(), (std::vector<int>{6, 7}));
  EXPECT_EQ(cm->mesh->world_rank_at({1, 1, 0}), 6);
  EXPECT_FALSE(make_counting_mesh(MeshLayout::parse("tsp=4").value(), 4, order, trace).ok());
}

}  // namespace
}  // namespace foldpar
