// The fast backend's matmul (OpenBLAS sgemm behind Backend::matmul) on the shapes of a
// training step, single thread, in GFLOP/s beside sgemm 2048^3 measured in the same run.
// Then decode's shapes (m = 1..8 rows, one token per sequence, against each weight): the
// backend (its skinny path for m <= 4) beside cblas_sgemm called directly on the same
// operands, interleaved, as microseconds per call and their ratio.
// Usage: matmul_bench [--model configs/small.json] [--tokens 1024,4096] [--rows 1,2,4,8] [--reps 9]
#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "bench_cli.h"
#include "core/timing.h"
#include "model/llama_config.h"
#include "sgemm_rate.h"

using namespace foldpar;

namespace {

struct Shape3 {
  const char* what;
  int64_t m, n, k;
  bool ta, tb;
};

double rate(Backend& be, const Shape3& s, int reps) {
  Tensor a = Tensor::zeros(s.ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, DType::kF32, MemCategory::kWorkspace);
  Tensor b = Tensor::zeros(s.tb ? Shape{s.n, s.k} : Shape{s.k, s.n}, DType::kF32, MemCategory::kWorkspace);
  Tensor c = Tensor::zeros({s.m, s.n}, DType::kF32, MemCategory::kWorkspace);
  const double secs = median_seconds({.reps = reps}, [&] { be.matmul(a, s.ta, b, s.tb, c); });
  return 2.0 * static_cast<double>(s.m * s.n * s.k) / secs / 1e9;
}

// Median seconds of the backend's matmul and of cblas_sgemm on the same [m, k] x [n, k]^T
// (tb) or [m, k] x [k, n] operands, alternating call by call.
struct PairTimes {
  double backend = 0, sgemm = 0, sgemv = 0;
};
PairTimes decode_pair(Backend& be, int64_t m, int64_t n, int64_t k, bool tb, int reps) {
  Tensor a = Tensor::empty({m, k}, DType::kF32, MemCategory::kWorkspace);
  Tensor b = Tensor::empty(tb ? Shape{n, k} : Shape{k, n}, DType::kF32, MemCategory::kWorkspace);
  std::fill_n(a.data<float>(), a.numel(), 0.5f);
  std::fill_n(b.data<float>(), b.numel(), 0.25f);
  Tensor c = Tensor::zeros({m, n}, DType::kF32, MemCategory::kWorkspace);
  auto direct = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), 1.0f, a.data<float>(), static_cast<int>(k), b.data<float>(),
                static_cast<int>(tb ? k : n), 0.0f, c.data<float>(), static_cast<int>(n));
  };
  auto rows_gemv = [&] {  // one sgemv per row of a
    for (int64_t i = 0; i < m; ++i)
      cblas_sgemv(CblasRowMajor, tb ? CblasNoTrans : CblasTrans, static_cast<int>(tb ? n : k),
                  static_cast<int>(tb ? k : n), 1.0f, b.data<float>(), static_cast<int>(tb ? k : n),
                  a.data<float>() + i * k, 1, 0.0f, c.data<float>() + i * n, 1);
  };
  be.matmul(a, false, b, tb, c);
  direct();
  rows_gemv();
  std::vector<double> mine, theirs, gemv;
  for (int i = 0; i < reps; ++i) {
    mine.push_back(seconds_of([&] { be.matmul(a, false, b, tb, c); }));
    theirs.push_back(seconds_of(direct));
    gemv.push_back(seconds_of(rows_gemv));
  }
  return {median(mine), median(theirs), median(gemv)};
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "configs/small.json";
  std::vector<int64_t> tokens = {1024, 4096};
  std::vector<int64_t> rows = {1, 2, 4, 8};
  int reps = 9;
  CLI::App app{"The CPU backend's matmul on the shapes of a training step and of decode", "matmul_bench"};
  app.add_option("--model", model, "model config (JSON)");
  app.add_option("--tokens", tokens, "token rows T of the training shapes, comma-separated")
      ->delimiter(',')
      ->check(bench::kPositive);
  app.add_option("--rows", rows, "rows m of the decode shapes, comma-separated")->delimiter(',')->check(bench::kPositive);
  app.add_option("--reps", reps, "timed calls per figure (median)")->check(bench::kPositive);
  if (std::optional<int> rc = bench::parse_flags(app, argc, argv)) return *rc;
  set_cpu_backend_threads(1);
  Result<LlamaConfig> config = LlamaConfig::load(model);
  if (!config.ok()) {
    std::fprintf(stderr, "matmul_bench: %s\n", config.status().to_string().c_str());
    return 2;
  }
  const LlamaConfig& c = config.value();
  const int64_t h = c.hidden_size, f = c.intermediate_size, kv = c.kv_dim(), V = c.vocab_size;
  auto be = make_cpu_backend();
  std::printf("sgemm 2048^3, 1 thread: %.1f GFLOP/s\n", bench::sgemm_gflops());
  std::printf("%-34s %6s %6s %6s %10s\n", "shape (y = x W^T and its gradients)", "M", "N", "K", "GFLOP/s");
  for (int64_t T : tokens) {
    const Shape3 shapes[] = {
        {"q/o projection fwd   [T,h]x[h,h]^T", T, h, h, false, true},
        {"k/v projection fwd   [T,h]x[kv,h]^T", T, kv, h, false, true},
        {"gate/up fwd          [T,h]x[f,h]^T", T, f, h, false, true},
        {"down fwd             [T,f]x[h,f]^T", T, h, f, false, true},
        {"lm head fwd          [T,h]x[V,h]^T", T, V, h, false, true},
        {"dx of q              [T,h]x[h,h]", T, h, h, false, false},
        {"dx of gate           [T,f]x[f,h]", T, h, f, false, false},
        {"dW of q              [T,h]^T x [T,h]", h, h, T, true, false},
        {"dW of gate           [T,f]^T x [T,h]", f, h, T, true, false},
        {"dW of down           [T,h]^T x [T,f]", h, f, T, true, false},
    };
    std::printf("T = %lld\n", static_cast<long long>(T));
    for (const Shape3& s : shapes)
      std::printf("  %-32s %6lld %6lld %6lld %10.1f\n", s.what, static_cast<long long>(s.m), static_cast<long long>(s.n),
                  static_cast<long long>(s.k), rate(*be, s, reps));
  }
  std::printf("decode: m rows against each weight, us per call (median of %d, alternating)\n", reps);
  std::printf("%-34s %4s %10s %10s %10s %8s\n", "shape", "m", "backend", "sgemm", "m x sgemv", "sgemm/be");
  for (int64_t m : rows) {
    const struct {
      const char* what;
      int64_t n, k;
      bool tb;
    } shapes[] = {
        {"q projection   [m,h]x[h,h]^T", h, h, true},
        {"gate/up        [m,h]x[f,h]^T", f, h, true},
        {"down           [m,f]x[h,f]^T", h, f, true},
        {"lm head        [m,h]x[V,h]^T", V, h, true},
        {"row update     [m,h]x[h,f]", f, h, false},
    };
    for (const auto& s : shapes) {
      const PairTimes t = decode_pair(*be, m, s.n, s.k, s.tb, reps);
      std::printf("  %-32s %4lld %10.1f %10.1f %10.1f %8.2f\n", s.what, static_cast<long long>(m), t.backend * 1e6,
                  t.sgemm * 1e6, t.sgemv * 1e6, t.sgemm / t.backend);
    }
  }
  std::printf("sgemm 2048^3 again: %.1f GFLOP/s\n", bench::sgemm_gflops());
  return 0;
}
