// The calibration (app/calibrate.h): each measurement is a small function; calibrate_hardware
// runs them in order on every rank and fills the description.
#include "app/calibrate.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <functional>
#include <thread>

#include "app/step_bench.h"
#include "backend/backend.h"
#include "backend/meta/meta_backend.h"
#include "backend/rope_table.h"
#include "core/timing.h"
#include "model/flop_count.h"
#include "plan/timeline.h"

namespace foldpar {
namespace {

// Seconds per call of fn, median of 5 batches after a warm-up; a batch repeats fn so that it
// lasts about 20 ms (short ops are below the clock's resolution otherwise). Not collective.
double seconds_per_call(const std::function<void()>& fn) {
  fn();
  const double t0 = now_seconds();
  fn();
  const double once = std::max(now_seconds() - t0, 1e-7);
  const int inner = static_cast<int>(std::clamp(0.02 / once, 1.0, 4096.0));
  return median_seconds({.reps = 5}, [&] {
           for (int i = 0; i < inner; ++i) fn();
         }) /
         inner;
}

Tensor filled(Backend& be, const Shape& shape, double v) {
  Tensor t = Tensor::empty(shape, DType::kF32, MemCategory::kWorkspace);
  be.fill(v, t);
  return t;
}

// GFLOP/s of the backend's f32 matmul [m x 1024] x [1024 x 1024].
double matmul_gflops(Backend& be, int64_t m) {
  const int64_t n = 1024;
  Tensor a = filled(be, {m, n}, 0.5), b = filled(be, {n, n}, 0.25);
  Tensor c = Tensor::empty({m, n}, DType::kF32, MemCategory::kWorkspace);
  const double s = seconds_per_call([&] { be.matmul(a, false, b, false, c); });
  return 2.0 * static_cast<double>(m * n * n) / s / 1e9;
}

struct AttentionSeconds {
  double forward = 0, backward = 0;
};

// One causal flash attention forward, and its backward, of one sequence of `seq` tokens with
// the config's heads.
AttentionSeconds attention_seconds(Backend& be, const LlamaConfig& c, int64_t seq) {
  const int64_t n_h = c.num_attention_heads, n_kv = c.num_key_value_heads, d = c.head_dim();
  Tensor q = filled(be, {1, seq, n_h, d}, 0.01), k = filled(be, {1, seq, n_kv, d}, 0.02);
  Tensor v = filled(be, {1, seq, n_kv, d}, 0.5), d_out = filled(be, {1, seq, n_h, d}, 0.1);
  Tensor out = Tensor::empty(q.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({1, n_h, seq}, DType::kF32, MemCategory::kWorkspace);
  Tensor dq = Tensor::empty(q.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor dk = Tensor::empty(k.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor dv = Tensor::empty(v.shape(), DType::kF32, MemCategory::kWorkspace);
  Tensor pos = Tensor::empty({seq}, DType::kI32, MemCategory::kWorkspace);
  for (int64_t i = 0; i < seq; ++i) pos.data<int32_t>()[i] = static_cast<int32_t>(i);
  const AttentionArgs args{&q, &k, &v, &pos, &pos, 1.0 / std::sqrt(static_cast<double>(d))};
  AttentionSeconds s;
  s.forward = seconds_per_call([&] { be.attention_forward(args, out, lse); });
  s.backward = seconds_per_call([&] { be.attention_backward(args, out, lse, d_out, dq, dk, dv); });
  return s;
}

// GB/s of y += x over `bytes`-sized f32 tensors: reads x and y, writes y.
double add_inplace_gb_per_s(Backend& be, int64_t bytes) {
  const int64_t n = bytes / 4;
  Tensor x = filled(be, {n}, 1e-6), y = filled(be, {n}, 0.0);
  const double s = seconds_per_call([&] { be.add_inplace(x, y); });
  return 3.0 * static_cast<double>(n * 4) / s / 1e9;
}

// The token-wise ops of a training step, each on the CPU backend at a step's widths (h = 512,
// f = 1376, 8 heads of 64) over T = 2048 rows: the bytes the dry run counts for one call
// (MetaBackend's record of the same call) over its median time. Successive calls cycle
// through kSets copies of the operands (24 MiB over the six for fill, 264 MiB for
// swiglu_backward), so that a call finds its data out of cache, as a step's op mostly does:
// on one set of 16 MiB operands rope ran at 104 GB/s, against 67 in a step.
std::vector<std::pair<std::string, double>> tokenwise_gb_per_s(Backend& be) {
  constexpr int kSets = 6;
  const int64_t T = 2048, h = 512, f = 1376, heads = 8, d = 64;
  struct Operands {
    Tensor x, w, y, dy, dx, dw, rstd, gate, up, out, d_gate, d_up, q;
  };
  std::vector<Operands> sets;
  for (int i = 0; i < kSets; ++i)
    sets.push_back({filled(be, {T, h}, 0.5), filled(be, {h}, 1.0), filled(be, {T, h}, 0.0), filled(be, {T, h}, 0.1),
                    filled(be, {T, h}, 0.0), filled(be, {h}, 0.0), filled(be, {T}, 1.0), filled(be, {T, f}, 0.3),
                    filled(be, {T, f}, 0.2), filled(be, {T, f}, 0.0), filled(be, {T, f}, 0.0), filled(be, {T, f}, 0.0),
                    filled(be, {1, T, heads, d}, 0.25)});
  std::vector<int32_t> positions(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) positions[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  const Tensor table = build_rope_table(be, positions, d, 10000.0, DType::kF32, MemCategory::kWorkspace);
  using Op = std::function<void(Backend&, Operands&)>;
  const std::pair<const char*, Op> ops[] = {
      {"rmsnorm_forward", [](Backend& b, Operands& o) { b.rmsnorm_forward(o.x, o.w, 1e-5, o.y, o.rstd); }},
      {"rmsnorm_backward", [](Backend& b, Operands& o) { b.rmsnorm_backward(o.x, o.w, o.rstd, o.dy, o.dx, o.dw); }},
      {"swiglu_forward", [](Backend& b, Operands& o) { b.swiglu_forward(o.gate, o.up, o.out); }},
      {"swiglu_backward", [](Backend& b, Operands& o) { b.swiglu_backward(o.gate, o.up, o.out, o.d_gate, o.d_up); }},
      {"rope_forward", [&table](Backend& b, Operands& o) { b.rope_forward(table, o.q); }},
      {"rope_backward", [&table](Backend& b, Operands& o) { b.rope_backward(table, o.q); }},
      {"add_inplace", [](Backend& b, Operands& o) { b.add_inplace(o.dy, o.y); }},
      {"copy", [](Backend& b, Operands& o) { b.copy(o.x, o.y); }},
      {"fill", [](Backend& b, Operands& o) { b.fill(0.0, o.y); }},
  };
  std::vector<std::pair<std::string, double>> rates;
  for (const auto& [name, op] : ops) {
    MetaBackend meta;
    op(meta, sets[0]);
    const OpRecord& r = meta.records().back();
    const double bytes = static_cast<double>(r.bytes_read + r.bytes_written);
    size_t next = 0;
    const double s = seconds_per_call([&] { op(be, sets[next++ % sets.size()]); });
    rates.emplace_back(name, bytes / s / 1e9);
  }
  return rates;
}

// The slowest rank's value: the smallest rate, or the largest time.
Result<double> slowest_rate(Communicator& world, double rate) {
  double neg = -rate;
  FP_RETURN_IF_ERROR(world.all_reduce(&neg, &neg, 1, DType::kF64, ReduceOp::kMax));
  return -neg;
}

// Seconds per call of a communication op, the slowest rank, median of `reps` batches of
// `inner` calls (the same on every rank), each batch started together after a barrier.
Result<double> collective_seconds(Communicator& world, int inner, const std::function<Status()>& op, int reps = 5) {
  FP_RETURN_IF_ERROR(op());  // warm-up: connections, buffers
  std::vector<double> secs;
  for (int rep = 0; rep < reps; ++rep) {
    FP_RETURN_IF_ERROR(world.barrier());
    const double t0 = now_seconds();
    for (int i = 0; i < inner; ++i) FP_RETURN_IF_ERROR(op());
    double s = (now_seconds() - t0) / inner;
    FP_RETURN_IF_ERROR(world.all_reduce(&s, &s, 1, DType::kF64, ReduceOp::kMax));
    secs.push_back(s);
  }
  return median(secs);
}

int64_t node_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  while (in >> key >> kb) {
    if (key == "MemTotal:") return kb * 1024;
    in.ignore(1 << 10, '\n');
  }
  return 0;
}

struct ComputeFigures {
  std::vector<std::pair<int64_t, double>> gemm_gflops;  // (M, GFLOP/s)
  double attention_fwd_gflops = 0, attention_bwd_gflops = 0, memory_gb_per_s = 0;
  double step_rest_gflops = 0;  // a training step without its attention
  // Attention at longer sequences too: (S, forward GFLOP/s, backward GFLOP/s), kAttentionSeqs.
  std::vector<std::array<double, 3>> attention_by_seq;
  std::vector<std::pair<std::string, double>> tokenwise_gb_per_s;  // (op, GB/s), the slowest rank's
};

LlamaConfig step_config() {
  LlamaConfig c;
  c.hidden_size = 512;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 8;
  c.intermediate_size = 1376;
  c.vocab_size = 256;
  c.num_hidden_layers = 2;
  c.max_position_embeddings = 4096;
  return c;
}

constexpr int64_t kSeq = 1024;
constexpr int64_t kAttentionSeqs[] = {1024, 2048, 4096};

Result<ComputeFigures> measure_compute(Communicator& world) {
  auto be = make_cpu_backend();
  ComputeFigures f;
  // The shape classes in interleaved rounds, each class's median over them: a disturbance of
  // a few hundred ms (another process, a page-cache flush) then spoils one round of several
  // classes instead of every batch of one. Measured back to back, one class once came out at
  // 0.60 of its neighbours and priced every GEMM of a model with h = 512 at that.
  constexpr int kGemmRounds = 3;
  std::vector<int64_t> classes;
  for (int64_t m = 32; m <= 1024; m *= 2) classes.push_back(m);
  std::vector<std::vector<double>> rates(classes.size());
  for (int round = 0; round < kGemmRounds; ++round)
    for (size_t i = 0; i < classes.size(); ++i) rates[i].push_back(matmul_gflops(*be, classes[i]));
  for (size_t i = 0; i < classes.size(); ++i) {
    FP_ASSIGN_OR_RETURN(const double g, slowest_rate(world, median(rates[i])));
    f.gemm_gflops.emplace_back(classes[i], g);
  }
  const LlamaConfig c = step_config();
  const AttentionSeconds attn = attention_seconds(*be, c, kSeq);
  const double fwd_flops = forward_attention_flops(c, 1, kSeq) / static_cast<double>(c.num_hidden_layers);
  FP_ASSIGN_OR_RETURN(f.attention_fwd_gflops, slowest_rate(world, fwd_flops / attn.forward / 1e9));
  FP_ASSIGN_OR_RETURN(f.attention_bwd_gflops, slowest_rate(world, 2.0 * fwd_flops / attn.backward / 1e9));
  for (int64_t seq : kAttentionSeqs) {
    const AttentionSeconds a = seq == kSeq ? attn : attention_seconds(*be, c, seq);
    const double flops = forward_attention_flops(c, 1, seq) / static_cast<double>(c.num_hidden_layers);
    FP_ASSIGN_OR_RETURN(const double fwd, slowest_rate(world, flops / a.forward / 1e9));
    FP_ASSIGN_OR_RETURN(const double bwd, slowest_rate(world, 2.0 * flops / a.backward / 1e9));
    f.attention_by_seq.push_back({static_cast<double>(seq), fwd, bwd});
  }
  FP_ASSIGN_OR_RETURN(f.memory_gb_per_s, slowest_rate(world, add_inplace_gb_per_s(*be, int64_t{64} << 20)));
  for (auto& [op, rate] : tokenwise_gb_per_s(*be)) {
    FP_ASSIGN_OR_RETURN(const double slowest, slowest_rate(world, rate));
    f.tokenwise_gb_per_s.emplace_back(op, slowest);
  }
  StepBenchOptions sb;
  sb.config = c;
  sb.seq = kSeq;
  sb.steps = 2;
  FP_ASSIGN_OR_RETURN(StepBenchReport step, run_step_bench(sb));
  // Attention's share of the step taken out: forward and backward once per layer.
  const double attn_s = (attn.forward + attn.backward) * static_cast<double>(c.num_hidden_layers);
  const double rest = (step.flops_per_step - 3.0 * fwd_flops * c.num_hidden_layers) /
                      std::max(step.median_seconds - attn_s, 0.5 * step.median_seconds) / 1e9;
  FP_ASSIGN_OR_RETURN(f.step_rest_gflops, slowest_rate(world, rest));
  return f;
}

struct LinkFigures {
  double latency_s = 0, gb_per_s = 0;
  double small_s = 0, large_s = 0;  // the send_recv times they come from
};

constexpr size_t kSmallBytes = 4, kLargeBytes = size_t{16} << 20;

// A ring step (every rank sends to p+1 while receiving from p-1) of 4 bytes and of 16 MiB:
// time = latency + bytes / bandwidth, solved from the two.
Result<LinkFigures> measure_link(Communicator& world) {
  const int p = world.rank(), N = world.size();
  std::vector<float> send(kLargeBytes / 4, 1.0f), recv(kLargeBytes / 4);
  auto ring = [&](size_t bytes) {
    return [&, bytes] { return world.send_recv(send.data(), recv.data(), bytes / 4, DType::kF32, (p + 1) % N, (p - 1 + N) % N); };
  };
  LinkFigures f;
  FP_ASSIGN_OR_RETURN(f.small_s, collective_seconds(world, 200, ring(kSmallBytes)));
  FP_ASSIGN_OR_RETURN(f.large_s, collective_seconds(world, 1, ring(kLargeBytes)));
  f.gb_per_s = static_cast<double>(kLargeBytes - kSmallBytes) / std::max(f.large_s - f.small_s, 1e-9) / 1e9;
  f.latency_s = std::max(0.0, f.small_s - static_cast<double>(kSmallBytes) / (f.gb_per_s * 1e9));
  return f;
}

// The compute time a transfer costs the ranks that compute beside it, as a share of the
// transfer's own time (Hardware::intra_node_copy_share): [256 x 1024] x [1024 x 1024] GEMMs
// for about 40 of the ring step's measured times, with a test() between any two (as the
// strategies progress their transfers) and 16 MiB ring steps kept in flight back to back
// (the next posted after about one step's time of GEMMs, once the one before is waited),
// against the same GEMMs with nothing in flight. The
// share is the GEMMs' slowdown over the steps' own time (count x `transfer_s`): 0 where a copy
// engine moves the bytes, 1 where this rank's core copies them, above 1 where the copies also
// slow the GEMMs beside them (memory bandwidth, caches). A stream of steps, not one: one
// step's 1-2 ms is within the GEMMs' own spread here. Median of 5 of each, interleaved, every
// rank at once after a barrier, the slowest rank.
Result<double> measure_copy_share(Communicator& world, double transfer_s, double* gemms_s, double* with_transfer_s,
                                  int* transfers) {
  const int p = world.rank(), N = world.size();
  auto be = make_cpu_backend();
  Tensor a = filled(*be, {256, 1024}, 0.5), b = filled(*be, {1024, 1024}, 0.25);
  Tensor c = Tensor::empty({256, 1024}, DType::kF32, MemCategory::kWorkspace);
  const double gemm_s = seconds_per_call([&] { be->matmul(a, false, b, false, c); });
  double calls_d = std::ceil(40.0 * transfer_s / std::max(gemm_s, 1e-7));
  FP_RETURN_IF_ERROR(world.all_reduce(&calls_d, &calls_d, 1, DType::kF64, ReduceOp::kMax));
  const int calls = static_cast<int>(std::clamp(calls_d, 16.0, 20000.0));
  std::vector<float> send(kLargeBytes / 4, 1.0f), recv(kLargeBytes / 4);
  // A step is posted every `stride` GEMMs (about one step's measured time), after the wait
  // for the one before: the same GEMM indices on every rank, so every step has both ends.
  double stride_d = std::ceil(transfer_s / std::max(gemm_s, 1e-7));
  FP_RETURN_IF_ERROR(world.all_reduce(&stride_d, &stride_d, 1, DType::kF64, ReduceOp::kMax));
  const int stride = static_cast<int>(std::clamp(stride_d, 1.0, static_cast<double>(calls)));
  auto run = [&](bool transfer) -> Result<std::pair<double, int>> {
    FP_RETURN_IF_ERROR(world.barrier());
    const double t0 = now_seconds();
    CommRequest req;
    int count = 0;
    for (int i = 0; i < calls; ++i) {
      if (transfer && i % stride == 0) {
        if (i > 0) FP_RETURN_IF_ERROR(req.wait());
        req = world.isend_recv(send.data(), recv.data(), send.size(), DType::kF32, (p + 1) % N, (p - 1 + N) % N);
        ++count;
      }
      be->matmul(a, false, b, false, c);
      if (transfer) {
        bool done = false;
        FP_RETURN_IF_ERROR(req.test(&done));
      }
    }
    FP_RETURN_IF_ERROR(req.wait());
    double s = now_seconds() - t0;
    FP_RETURN_IF_ERROR(world.all_reduce(&s, &s, 1, DType::kF64, ReduceOp::kMax));
    return std::pair<double, int>{s, count};
  };
  FP_RETURN_IF_ERROR(run(true).status());  // warm-up
  std::vector<double> alone, both;
  int counted = 0;
  for (int rep = 0; rep < 5; ++rep) {
    FP_ASSIGN_OR_RETURN(const auto x, run(false));
    FP_ASSIGN_OR_RETURN(const auto y, run(true));
    alone.push_back(x.first);
    both.push_back(y.first);
    counted = y.second;  // the same in every run
  }
  *gemms_s = median(alone);
  *with_transfer_s = median(both);
  *transfers = counted;
  return std::clamp((*with_transfer_s - *gemms_s) / (counted * std::max(transfer_s, 1e-9)), 0.0,
                    Hardware::kMaxCopyShare);
}

// One call of `kind` over the full tensor `a` (`full` floats, N divides it) into `b`, in the
// blocking form or as the i-form and its wait at once: the two go through different MPI
// algorithms (hardware.h). broadcast and reduce are rooted at rank 0.
Status run_kind(Communicator& world, CommKind kind, bool blocking, float* a, float* b, size_t full) {
  const int p = world.rank(), N = world.size();
  const size_t part = full / static_cast<size_t>(N);
  if (blocking) {
    switch (kind) {
      case CommKind::kSendRecv: return world.send_recv(a, b, full, DType::kF32, (p + 1) % N, (p - 1 + N) % N);
      case CommKind::kAllReduce: return world.all_reduce(a, b, full, DType::kF32, ReduceOp::kSum);
      case CommKind::kAllGather: return world.all_gather(a, b, part, DType::kF32);
      case CommKind::kReduceScatter: return world.reduce_scatter(a, b, part, DType::kF32, ReduceOp::kSum);
      case CommKind::kBroadcast: return world.broadcast(a, full, DType::kF32, 0);
      default: return world.reduce(a, b, full, DType::kF32, ReduceOp::kSum, 0);
    }
  }
  CommRequest r;
  switch (kind) {
    case CommKind::kSendRecv: r = world.isend_recv(a, b, full, DType::kF32, (p + 1) % N, (p - 1 + N) % N); break;
    case CommKind::kAllReduce: r = world.iall_reduce(a, b, full, DType::kF32, ReduceOp::kSum); break;
    case CommKind::kAllGather: r = world.iall_gather(a, b, part, DType::kF32); break;
    case CommKind::kReduceScatter: r = world.ireduce_scatter(a, b, part, DType::kF32, ReduceOp::kSum); break;
    case CommKind::kBroadcast: r = world.ibroadcast(a, full, DType::kF32, 0); break;
    default: r = world.ireduce(a, b, full, DType::kF32, ReduceOp::kSum, 0); break;
  }
  return r.wait();
}

// The bytes transfer_seconds counts for `kind` over a full tensor of `bytes` on N ranks
// (comm_stats.h): all_reduce 2 (N-1)/N, all_gather and reduce_scatter (N-1)/N, the others
// (the chain's broadcast and reduce, a ring step) the whole.
double counted_bytes(CommKind kind, size_t bytes, size_t N) {
  const double b = static_cast<double>(bytes);
  if (kind == CommKind::kAllReduce) return 2.0 * static_cast<double>(N - 1) * b / static_cast<double>(N);
  if (kind == CommKind::kAllGather || kind == CommKind::kReduceScatter) return static_cast<double>(N - 1) * b / static_cast<double>(N);
  return b;
}

// all_reduce, all_gather and reduce_scatter of a few bytes and of 16 MiB (the full tensor),
// each measured beside the ring model's prediction from `hw`'s link figures with efficiency
// 1 (bytes by comm_stats.h's convention; N divides the counts, so all_reduce of n moves
// 2 (N-1)/N n, all_gather and reduce_scatter of N c move (N-1) c per rank each way). The
// 16 MiB ones set collective_efficiency: the ring's bandwidth time over the measured time
// less the ring's latency, at most 1.
Status measure_collectives(Communicator& world, Hardware& hw) {
  const size_t N = static_cast<size_t>(world.size());
  const size_t large = (size_t{16} << 20) / 4 / N * N;  // floats of the full tensor
  std::vector<float> a(large, 1.0f), b(large);
  struct Case {
    CommKind kind;
    size_t full;  // floats of the full tensor (all_reduce's n, all_gather's result, reduce_scatter's input)
    int inner;
  };
  const Case cases[] = {{CommKind::kAllReduce, N, 200},     {CommKind::kAllReduce, large, 1},
                        {CommKind::kAllGather, N, 200},     {CommKind::kAllGather, large, 1},
                        {CommKind::kReduceScatter, N, 200}, {CommKind::kReduceScatter, large, 1}};
  for (const Case& c : cases) {
    FP_ASSIGN_OR_RETURN(const double s, collective_seconds(world, c.inner, [&] {
                          return run_kind(world, c.kind, /*blocking=*/true, a.data(), b.data(), c.full);
                        }));
    CommStart model;
    model.kind = c.kind;
    model.comm_size = static_cast<int>(N);
    model.link = LinkClass::kIntraNode;
    const uint64_t bytes = 4 * c.full;
    model.bytes_sent = model.bytes_received = static_cast<uint64_t>(counted_bytes(c.kind, bytes, N));
    const double ring_s = transfer_seconds(model, hw);
    const std::string key = fmt::format("{}_{}B", comm_kind_name(c.kind), bytes);
    hw.measured.emplace_back(key + "_s", s);
    hw.measured.emplace_back(key + "_ring_model_s", ring_s);
    if (c.full == large) {
      const double latency_s = latency_steps(c.kind, model.comm_size) * hw.intra_node_latency_s;
      const double eff = (ring_s - latency_s) / std::max(s - latency_s, 1e-12);
      hw.collective_efficiency.emplace_back(comm_kind_name(c.kind), std::clamp(eff, 1e-3, 1.0));
    }
  }
  return Status();
}

// The message sizes of the size tables (Hardware::intra_node_gb_per_s_by_bytes), full
// tensors: from what fits the caches to what a step at S = 8192-32768 moves (an activation
// [S, 512] f32 is 16-64 MiB).
constexpr size_t kTableBytes[] = {size_t{1} << 20, size_t{4} << 20, size_t{16} << 20, size_t{64} << 20};

// The size tables: send_recv, all_reduce, all_gather, reduce_scatter, broadcast and reduce,
// each blocking (key: the kind) and non-blocking (key: "i" + the kind), at kTableBytes; a
// point's rate is the counted bytes over (the measured time less the latency steps). Each
// point is the slowest rank's median of 3 calls after a warm-up; inter-node set equal (one
// node). Every time is in `measured` too.
Status measure_size_tables(Communicator& world, Hardware& hw) {
  const size_t N = static_cast<size_t>(world.size());
  const size_t most = kTableBytes[std::size(kTableBytes) - 1] / 4 / N * N;
  std::vector<float> a(most, 1.0f), b(most);
  const CommKind kinds[] = {CommKind::kSendRecv,      CommKind::kAllReduce, CommKind::kAllGather,
                            CommKind::kReduceScatter, CommKind::kBroadcast, CommKind::kReduce};
  for (CommKind kind : kinds) {
    for (bool blocking : {true, false}) {
      const std::string key = std::string(blocking ? "" : "i") + comm_kind_name(kind);
      std::vector<Hardware::SizePoint> points;
      for (size_t bytes : kTableBytes) {
        const size_t full = bytes / 4 / N * N;
        FP_ASSIGN_OR_RETURN(const double s, collective_seconds(world, 1, [&] { return run_kind(world, kind, blocking, a.data(), b.data(), full); }, 3));
        const double latency_s = latency_steps(kind, static_cast<int>(N)) * hw.intra_node_latency_s;
        const double counted = counted_bytes(kind, 4 * full, N);
        points.push_back({counted, counted / std::max(s - latency_s, 1e-9) / 1e9});
        hw.measured.emplace_back(fmt::format("size_table_{}_{}MiB_s", key, bytes >> 20), s);  // apart from measure_link's names
      }
      hw.intra_node_gb_per_s_by_bytes.emplace_back(key, std::move(points));
    }
  }
  hw.inter_node_gb_per_s_by_bytes = hw.intra_node_gb_per_s_by_bytes;
  return Status();
}

}  // namespace

Result<Hardware> calibrate_hardware(Communicator& world) {
  if (world.size() < 2)
    return invalid_argument("calibrate measures the links between ranks: run it under mpirun -np 2 (got {} rank)", world.size());
  set_cpu_backend_threads(1);
  FP_ASSIGN_OR_RETURN(const ComputeFigures cf, measure_compute(world));
  FP_ASSIGN_OR_RETURN(const LinkFigures link, measure_link(world));
  Hardware h;
  h.name = "this-machine";
  h.devices_per_node = world.size();
  h.memory_per_device_gb = static_cast<double>(node_memory_bytes()) / world.size() / 1e9;
  double best = 0;
  for (const auto& [m, g] : cf.gemm_gflops) best = std::max(best, g);
  h.peak_tflops_f32 = best / 1e3;
  h.peak_tflops_bf16 = 0;  // bf16 is a storage type here: the math is f32
  for (const auto& [m, g] : cf.gemm_gflops) {
    h.gemm_efficiency_by_min_dim.emplace_back(static_cast<double>(m), g / best);
    h.measured.emplace_back(fmt::format("gemm_f32_{}x1024x1024_gflops", m), g);
  }
  h.attention_fwd_efficiency = std::min(1.0, cf.attention_fwd_gflops / best);
  h.attention_bwd_efficiency = std::min(1.0, cf.attention_bwd_gflops / best);
  // Forward and backward together (3 forward FLOPs): the harmonic mix of the two rates.
  h.attention_efficiency = std::min(1.0, 3.0 / (1.0 / cf.attention_fwd_gflops + 2.0 / cf.attention_bwd_gflops) / best);
  h.matmul_efficiency = std::min(1.0, cf.step_rest_gflops / best);
  h.memory_gb_per_s = cf.memory_gb_per_s;
  h.tokenwise_gb_per_s_by_op = cf.tokenwise_gb_per_s;
  h.intra_node_gb_per_s = h.inter_node_gb_per_s = link.gb_per_s;
  h.intra_node_latency_s = h.inter_node_latency_s = link.latency_s;
  double gemms_s = 0, with_transfer_s = 0;
  int copy_share_transfers = 0;
  FP_ASSIGN_OR_RETURN(h.intra_node_copy_share,
                      measure_copy_share(world, link.large_s, &gemms_s, &with_transfer_s, &copy_share_transfers));
  h.inter_node_copy_share = h.intra_node_copy_share;
  h.overlap_efficiency = 0.5;
  h.measured.emplace_back("attention_fwd_gflops", cf.attention_fwd_gflops);
  h.measured.emplace_back("attention_bwd_gflops", cf.attention_bwd_gflops);
  for (const auto& [seq, fwd, bwd] : cf.attention_by_seq) {
    h.attention_efficiency_by_seq.push_back({seq, std::min(1.0, fwd / best), std::min(1.0, bwd / best)});
    h.measured.emplace_back(fmt::format("attention_fwd_S{}_gflops", seq), fwd);
    h.measured.emplace_back(fmt::format("attention_bwd_S{}_gflops", seq), bwd);
  }
  h.measured.emplace_back("add_inplace_gb_per_s", cf.memory_gb_per_s);
  h.measured.emplace_back("training_step_without_attention_gflops", cf.step_rest_gflops);
  h.measured.emplace_back("send_recv_4B_s", link.small_s);
  h.measured.emplace_back("send_recv_16MiB_s", link.large_s);
  h.measured.emplace_back("copy_share_gemms_alone_s", gemms_s);
  h.measured.emplace_back("copy_share_gemms_with_send_recv_16MiB_s", with_transfer_s);
  h.measured.emplace_back("copy_share_send_recv_16MiB_count", copy_share_transfers);
  FP_RETURN_IF_ERROR(measure_collectives(world, h));
  FP_RETURN_IF_ERROR(measure_size_tables(world, h));
  h.notes = fmt::format(
      "Measured by `foldpar calibrate` with {} MPI ranks on one node ({} hardware threads), each rank a device, all "
      "measuring at once on the CPU backend with one thread, the slowest rank's figures: f32 GEMM [M x 1024] x "
      "[1024 x 1024] for M = 32..1024 (each the median of 3 interleaved rounds), best {:.2f} GFLOP/s (peak_tflops_f32; the table is each M over it); causal "
      "flash attention S={}, 8 heads of 64, forward {:.2f} and backward {:.2f} GFLOP/s (attention_efficiency_by_seq: "
      "the same at S = 1024, 2048, 4096 over the best GEMM); add_inplace over 64 MiB, "
      "{:.2f} GB/s (memory_gb_per_s); tokenwise_gb_per_s_by_op = each token-wise op of a step on T = 2048 rows "
      "(h = 512, f = 1376, 8 heads of 64), successive calls on 6 copies of the operands (out of cache), the bytes "
      "the dry run counts for a call over its median time; a ring send_recv of 4 B ({:.3g} s) and 16 MiB ({:.3g} s) solved for latency "
      "{:.3g} s and {:.3f} GB/s one way (inter-node set equal: one node); matmul_efficiency = the rest of a "
      "single-rank training step (h=512, L=2, S={}; its attention time taken out) at {:.2f} GFLOP/s over the best "
      "GEMM; collective_efficiency = the ring model's bandwidth time over the measured one for all_reduce, all_gather and reduce_scatter of 16 MiB; `measured` has the raw figures and those collectives (also of a few bytes) beside the ring model's at efficiency 1; "
      "intra_node_copy_share {:.2f} = (GEMMs with {} 16 MiB ring steps in flight one after another, test() between "
      "them, {:.3g} s - the same GEMMs alone, {:.3g} s) / the steps' time, clamped to [0, {}] (inter-node set equal: "
      "one node); intra_node_gb_per_s_by_bytes (inter-node set equal) = send_recv, all_reduce, all_gather, "
      "reduce_scatter, broadcast and reduce of 1, 4, 16 and 64 MiB, blocking (the kind) and the i-form waited at "
      "once (i + the kind), each the counted bytes over the median of 3 calls less the latency steps. Stated, not "
      "measured: overlap_efficiency 0.5 (unused by the timeline) and one transfer at a time per link.",
      world.size(), std::thread::hardware_concurrency(), best, kSeq, cf.attention_fwd_gflops, cf.attention_bwd_gflops,
      cf.memory_gb_per_s, link.small_s, link.large_s, link.latency_s, link.gb_per_s, kSeq, cf.step_rest_gflops,
      h.intra_node_copy_share, copy_share_transfers, with_transfer_s, gemms_s, Hardware::kMaxCopyShare);
  FP_RETURN_IF_ERROR(h.validate());
  return h;
}

}  // namespace foldpar
