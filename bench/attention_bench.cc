// Single-thread throughput of the blocked flash attention kernel (the fast CPU backend's
// attention_forward / attention_backward), in useful GFLOP/s beside the best single-thread
// f32 GEMM (2048^3, the faster of OpenBLAS and oneDNN: sgemm_rate.h) measured just before
// each row. Useful FLOPs per head and visible
// (query, key) pair: forward 4d (QK^T, PV), backward 8d (dV, dP, dQ, dK; recomputing S is not
// counted). Causal, B = 1, n_h = h / d, n_kv = n_h / group, positions 0..S-1: S(S+1)/2 pairs.
//
//   attention_bench [--S=512,1024,2048,4096,8192] [--d=64,128] [--h=1024] [--group=1]
//                   [--reps=5] [--seconds=4] [--bf16]
// --bf16: instead, per row the f32 kernel and the bf16 one (bf16 Q, K, V, dO through the
// bf16 storage decorator, as `train --bf16` runs attention: bf16 tile products where the CPU
// multiplies bf16, widened to the f32 kernel elsewhere) and the widening path forced (the
// decorator over a backend without bf16 products), timed round by round interleaved; each
// ratio is the median over rounds of that round's f32 time / bf16 time.
// Each figure is the median of `reps` timed runs (fewer when one run is longer than
// seconds / reps, never fewer than 3), after one untimed warm-up run; times are the calling
// thread's CPU time, so that other processes sharing the machine distort them less.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "backend/bf16_storage_backend.h"
#include "backend/cpu/gemm_engine.h"
#include "backend/machine_rates.h"
#include "backend/timed_backend.h"
#include "bench_cli.h"
#include "core/rng.h"
#include "core/timing.h"

namespace foldpar {
namespace {

struct Options {
  std::vector<int64_t> seq_lens{512, 1024, 2048, 4096, 8192};
  std::vector<int64_t> head_dims{64, 128};
  int64_t hidden = 1024;  // n_h * d
  int64_t group = 1;      // n_h / n_kv
  int reps = 5;
  double seconds = 4.0;   // time budget per figure, bounds the repetitions of the large sizes
  bool bf16 = false;      // f32 beside bf16, interleaved (run_bf16_row)
};

// Median seconds of one call of fn: thread CPU time, `reps` calls within the time budget.
double cpu_median_seconds(const std::function<void()>& fn, const Options& o) {
  return median_seconds({.reps = o.reps, .clock = Clock::kThreadCpu, .budget_seconds = o.seconds}, fn);
}

Tensor random_tensor(const Shape& shape, uint64_t stream) {
  Tensor t = Tensor::empty(shape, DType::kF32, MemCategory::kActivations);
  float* x = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) x[i] = static_cast<float>(uniform_at(1, stream, i) * 2 - 1);
  return t;
}

double sgemm_gflops(int m, int n, int k, bool trans_b, const Options& o) {
  const Tensor a = random_tensor({m, k}, 1), b = random_tensor({k, n}, 2);
  Tensor c = Tensor::empty({m, n}, DType::kF32, MemCategory::kWorkspace);
  const double t = cpu_median_seconds(
      [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, 1.0f,
                    a.data<float>(), k, b.data<float>(), trans_b ? k : n, 0.0f, c.data<float>(), n);
      },
      o);
  return 2.0 * m * n * k / t * 1e-9;
}

// One row's causal inputs: Q, K, V, dO and the positions 0..S-1; none (with a line saying
// so) when h and the group do not give whole heads.
struct RowInputs {
  int64_t n_h = 0, n_kv = 0;
  Tensor q, k, v, d_out, pos;
};
std::optional<RowInputs> row_inputs(int64_t S, int64_t d, const Options& o) {
  RowInputs r;
  r.n_h = o.hidden / d;
  r.n_kv = r.n_h / o.group;
  if (r.n_h < 1 || r.n_kv < 1 || r.n_h % r.n_kv != 0) {
    std::printf("skip S=%ld d=%ld: h=%ld, group=%ld do not give whole heads\n", S, d, o.hidden, o.group);
    return std::nullopt;
  }
  r.q = random_tensor({1, S, r.n_h, d}, 3);
  r.k = random_tensor({1, S, r.n_kv, d}, 4);
  r.v = random_tensor({1, S, r.n_kv, d}, 5);
  r.d_out = random_tensor({1, S, r.n_h, d}, 6);
  r.pos = Tensor::empty({S}, DType::kI32, MemCategory::kActivations);
  for (int64_t i = 0; i < S; ++i) r.pos.data<int32_t>()[i] = static_cast<int32_t>(i);
  return r;
}

void run_attention(int64_t S, int64_t d, const Options& o) {
  std::optional<RowInputs> in = row_inputs(S, d, o);
  if (!in) return;
  const int64_t n_h = in->n_h, n_kv = in->n_kv;
  const Tensor &q = in->q, &k = in->k, &v = in->v, &d_out = in->d_out, &pos = in->pos;
  Tensor out = Tensor::empty(q.shape(), DType::kF32, MemCategory::kActivations);
  Tensor lse = Tensor::empty({1, n_h, S}, DType::kF32, MemCategory::kActivations);
  Tensor dq = Tensor::empty(q.shape(), DType::kF32, MemCategory::kActivations);
  Tensor dk = Tensor::empty(k.shape(), DType::kF32, MemCategory::kActivations);
  Tensor dv = Tensor::empty(v.shape(), DType::kF32, MemCategory::kActivations);
  const AttentionArgs args{&q, &k, &v, &pos, &pos, 1.0 / std::sqrt(static_cast<double>(d))};
  auto backend = make_cpu_backend();

  // The reference rate is measured again for every row: the machine is shared, and a ratio
  // is only meaningful against a rate taken at the same time.
  const GemmYardstick best = measure_gemm_yardstick(2048, std::max(o.reps, 3));
  const double sgemm_rate = best.best_gflops;
  const double fwd_s = cpu_median_seconds([&] { backend->attention_forward(args, out, lse); }, o);
  const double bwd_s =
      cpu_median_seconds([&] { backend->attention_backward(args, out, lse, d_out, dq, dk, dv); }, o);
  const double pairs = static_cast<double>(S) * (S + 1) / 2;
  const double fwd = 4.0 * d * pairs * n_h / fwd_s * 1e-9, bwd = 8.0 * d * pairs * n_h / bwd_s * 1e-9;
  std::printf("%6ld %4ld %4ld %4ld %9.1f %-8s %10.2f %9.1f %6.0f%% %10.2f %9.1f %6.0f%%\n", S, d, n_h, n_kv,
              sgemm_rate, best.best_engine.c_str(), fwd_s * 1e3, fwd, 100 * fwd / sgemm_rate, bwd_s * 1e3, bwd,
              100 * bwd / sgemm_rate);
  std::fflush(stdout);
}

Tensor rounded(const Tensor& t) {  // t rounded to bf16
  Tensor o = Tensor::empty(t.shape(), DType::kBF16, MemCategory::kActivations);
  for (int64_t i = 0; i < t.numel(); ++i) o.data<bf16>()[i] = f32_to_bf16(t.data<float>()[i]);
  return o;
}

// One attention problem's tensors in one dtype; lse is f32 as the bf16 layouts keep it.
struct Problem {
  Tensor q, k, v, d_out, out, lse, dq, dk, dv;
  AttentionArgs args;
};
Problem make_problem(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& d_out, const Tensor& pos,
                     double scale) {
  const DType t = q.dtype();
  const auto like = [t](const Tensor& x) { return Tensor::empty(x.shape(), t, MemCategory::kActivations); };
  Problem p{q, k, v, d_out, like(q), Tensor::empty({q.dim(0), q.dim(2), q.dim(1)}, DType::kF32, MemCategory::kActivations),
            like(q), like(k), like(v), {}};
  p.args = AttentionArgs{&p.q, &p.k, &p.v, &pos, &pos, scale};
  return p;
}

// f32, bf16 (native where the CPU multiplies bf16) and bf16 widened, forward and backward,
// each timed once per round in turn, `reps` rounds.
void run_bf16_row(int64_t S, int64_t d, const Options& o) {
  std::optional<RowInputs> in = row_inputs(S, d, o);
  if (!in) return;
  const int64_t n_h = in->n_h, n_kv = in->n_kv;
  const Tensor &q = in->q, &k = in->k, &v = in->v, &d_out = in->d_out, &pos = in->pos;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Problem f32 = make_problem(q, k, v, d_out, pos, scale);
  Problem b16 = make_problem(rounded(q), rounded(k), rounded(v), rounded(d_out), pos, scale);
  auto cpu = make_cpu_backend();
  TimedBackend no_bf16_products(*cpu);  // answers matmul_takes_bf16 false: the decorator widens
  auto native = make_bf16_storage_backend(*cpu), widened = make_bf16_storage_backend(no_bf16_products);
  struct Variant {
    Backend* be;
    Problem* p;
    std::vector<double> fwd, bwd;
  };
  Variant vs[3] = {{cpu.get(), &f32, {}, {}}, {native.get(), &b16, {}, {}}, {widened.get(), &b16, {}, {}}};
  auto fwd = [](Variant& x) { x.be->attention_forward(x.p->args, x.p->out, x.p->lse); };
  auto bwd = [](Variant& x) {
    x.be->attention_backward(x.p->args, x.p->out, x.p->lse, x.p->d_out, x.p->dq, x.p->dk, x.p->dv);
  };
  for (Variant& x : vs) {  // warm-up: primitives created, pages touched
    fwd(x);
    bwd(x);
  }
  const double round_start = now_seconds();
  for (int r = 0; r < std::max(o.reps, 3); ++r) {
    for (Variant& x : vs) {
      x.fwd.push_back(seconds_of([&] { fwd(x); }, Clock::kThreadCpu));
      x.bwd.push_back(seconds_of([&] { bwd(x); }, Clock::kThreadCpu));
    }
    if (r + 1 >= 3 && now_seconds() - round_start > o.seconds) break;
  }
  const double pairs = static_cast<double>(S) * (S + 1) / 2, flop = 4.0 * d * pairs * n_h;
  auto gf = [](double flops, const std::vector<double>& t) { return flops / median(t) * 1e-9; };
  auto ratio = [](const std::vector<double>& num, const std::vector<double>& den) {
    std::vector<double> r;
    for (size_t i = 0; i < num.size(); ++i) r.push_back(num[i] / den[i]);
    return median(r);
  };
  std::printf("%6ld %4ld %4ld %4ld %3zu | %8.1f %8.1f %8.1f %6.2f %6.2f | %8.1f %8.1f %8.1f %6.2f %6.2f\n", S, d, n_h,
              n_kv, vs[0].fwd.size(), gf(flop, vs[0].fwd), gf(flop, vs[1].fwd), gf(flop, vs[2].fwd),
              ratio(vs[0].fwd, vs[1].fwd), ratio(vs[0].fwd, vs[2].fwd), gf(2 * flop, vs[0].bwd), gf(2 * flop, vs[1].bwd),
              gf(2 * flop, vs[2].bwd), ratio(vs[0].bwd, vs[1].bwd), ratio(vs[0].bwd, vs[2].bwd));
  std::fflush(stdout);
}

int run_bf16(const Options& o) {
  openblas_set_num_threads(1);
  set_gemm_threads(1);
  std::printf("%s, 1 thread\n", gemm_engine_report().summary().c_str());
  std::printf("GFLOP/s (useful; median over rounds) of f32, bf16 (the decorator's path here: %s) and bf16 widened\n"
              "(forced); x: median over rounds of f32 time / bf16 time (bf16 native, bf16 widened)\n",
              gemm_engine_report().bf16_native ? "bf16 tile products" : "widened, no bf16 instructions");
  std::printf("%6s %4s %4s %4s %3s | %8s %8s %8s %6s %6s | %8s %8s %8s %6s %6s\n", "S", "d", "n_h", "n_kv", "rnd",
              "fwd f32", "fwd bf16", "fwd wide", "x bf16", "x wide", "bwd f32", "bwd bf16", "bwd wide", "x bf16",
              "x wide");
  for (int64_t d : o.head_dims)
    for (int64_t S : o.seq_lens) run_bf16_row(S, d, o);
  return 0;
}

int run(const Options& o) {
  if (o.bf16) return run_bf16(o);
  openblas_set_num_threads(1);
  std::printf("OpenBLAS %s, core %s, 1 thread\n", openblas_get_config(), openblas_get_corename());
  const double qk = sgemm_gflops(4096, 4096, 128, true, o);
  std::printf("for reference: OpenBLAS sgemm 4096x4096x128 (NT, shaped like Q K^T at S = 4096, d = 128): %.1f GFLOP/s\n",
              qk);
  std::printf("gemm: the best engine's 2048x2048x2048 NN, measured just before each row; ratios are against it\n");
  std::printf("%6s %4s %4s %4s %9s %-8s %10s %9s %7s %10s %9s %7s\n", "S", "d", "n_h", "n_kv", "gemm GF", "engine",
              "fwd ms", "fwd GF/s", "fwd/gemm", "bwd ms", "bwd GF/s", "bwd/gemm");
  for (int64_t d : o.head_dims)
    for (int64_t S : o.seq_lens) run_attention(S, d, o);
  return 0;
}

}  // namespace
}  // namespace foldpar

int main(int argc, char** argv) {
  foldpar::Options o;
  CLI::App app{"Single-thread throughput of the CPU backend's flash attention beside the best f32 GEMM", "attention_bench"};
  app.add_option("--S", o.seq_lens, "sequence lengths, comma-separated")->delimiter(',')->check(foldpar::bench::kPositive);
  app.add_option("--d", o.head_dims, "head dims, comma-separated")->delimiter(',')->check(foldpar::bench::kPositive);
  app.add_option("--h", o.hidden, "hidden size n_h * d")->check(foldpar::bench::kPositive);
  app.add_option("--group", o.group, "n_h / n_kv")->check(foldpar::bench::kPositive);
  app.add_option("--reps", o.reps, "timed runs per figure (at most)")->check(foldpar::bench::kPositive);
  app.add_option("--seconds", o.seconds, "time budget per figure")->check(foldpar::bench::kPositive);
  app.add_flag("--bf16", o.bf16, "f32 beside bf16 (native and widened), interleaved round by round");
  if (std::optional<int> rc = foldpar::bench::parse_flags(app, argc, argv)) return *rc;
  return foldpar::run(o);
}
