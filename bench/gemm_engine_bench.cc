// The GEMM engines side by side: OpenBLAS sgemm, oneDNN f32, oneDNN bf16 (f32 accumulation
// and output) and, for decode's few rows, the skinny kernel, on the shape classes of a model
// config (its projections at T tokens, in the three transposes a training step uses: NT
// forward, NN data gradient, TN weight gradient) and 2048^3. Engines and shapes are
// interleaved round by round so that a loaded machine slows them alike; medians over the
// rounds and ratios to OpenBLAS are printed, with the oneDNN implementation each used.
//
//   gemm_engine_bench [--model configs/small.json] [--tokens 1024] [--rounds 7] [--threads 1]
//                     [--seconds 0.05 per measurement] [--beta 0] [--cold-mib 0]
//
// --cold-mib M: each shape rotates over copies of its operands that together pass M MiB, so that
// every call reads its operands from memory as a training step does (a step's products rarely
// find their operands in cache), instead of the warm repeat of one set (0, the default).
//
// Figures: docs/PERFORMANCE.md, "GEMM engines". Prints; asserts nothing.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backend/cpu/gemm_engine.h"
#include "model/llama_config.h"

namespace {

using foldpar::GemmEngine;
using foldpar::MatmulDims;

struct Shape {
  std::string name;
  int64_t m, n, k;
  bool ta, tb;
};

// op(a) [m, k] op(b) [k, n]; a stored [k, m] when ta, b stored [n, k] when tb.
MatmulDims dims_of(const Shape& s) { return {s.m, s.n, s.k, s.ta ? s.m : s.k, s.tb ? s.k : s.n}; }

std::vector<Shape> shapes_of(const foldpar::LlamaConfig& c, int64_t T) {
  const int64_t h = c.hidden_size, f = c.intermediate_size, V = c.vocab_size;
  const int64_t kv = c.kv_dim();
  struct Proj {
    const char* name;
    int64_t in, out;
  };
  std::vector<Proj> projs = {{"h->h", h, h}, {"h->f", h, f}, {"f->h", f, h}, {"h->V", h, V}};
  if (kv != h) projs.push_back({"h->kv", h, kv});
  std::vector<Shape> out;
  for (const Proj& p : projs) {
    out.push_back({std::string("NT fwd ") + p.name, T, p.out, p.in, false, true});       // x W^T
    out.push_back({std::string("NN dgrad ") + p.name, T, p.in, p.out, false, false});    // dy W
    out.push_back({std::string("TN wgrad ") + p.name, p.out, p.in, T, true, false});     // dy^T x
  }
  for (int64_t rows : {1, 4}) out.push_back({"NT decode m=" + std::to_string(rows) + " h->f", rows, f, h, false, true});
  out.push_back({"NN 2048^3", 2048, 2048, 2048, false, false});
  return out;
}

enum class Variant { kOpenBlas, kOneDnnF32, kSkinny, kOneDnnBf16 };
struct Operands {  // `copies` sets laid end to end; calls rotate over them (--cold-mib)
  std::vector<float> a, b, c;
  std::vector<foldpar::bf16> a16, b16;
  int64_t copies = 1, next = 0;
};

Operands make_operands(const Shape& s, double cold_mib) {
  Operands o;
  const double set_bytes = 4.0 * static_cast<double>(s.m * s.k + s.k * s.n + s.m * s.n);
  o.copies = cold_mib > 0 ? std::max<int64_t>(2, static_cast<int64_t>(cold_mib * 1048576.0 / set_bytes) + 1) : 1;
  o.a.resize(static_cast<size_t>(s.m * s.k * o.copies));
  o.b.resize(static_cast<size_t>(s.k * s.n * o.copies));
  o.c.resize(static_cast<size_t>(s.m * s.n * o.copies));
  uint64_t state = 12345;
  for (auto* v : {&o.a, &o.b})
    for (float& x : *v) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      x = static_cast<float>(static_cast<double>(state >> 11) / 9007199254740992.0 - 0.5);
    }
  for (float x : o.a) o.a16.push_back(foldpar::f32_to_bf16(x));
  for (float x : o.b) o.b16.push_back(foldpar::f32_to_bf16(x));
  return o;
}

float g_beta = 0;  // --beta: 1 is the accumulation of the step's gradients and residuals

void run_once(Variant v, const Shape& s, Operands& o) {
  const MatmulDims d = dims_of(s);
  const int64_t i = o.next;
  o.next = (o.next + 1) % o.copies;
  const float* a = o.a.data() + i * s.m * s.k;
  const float* b = o.b.data() + i * s.k * s.n;
  float* c = o.c.data() + i * s.m * s.n;
  switch (v) {
    case Variant::kOpenBlas:
      return foldpar::gemm_f32(GemmEngine::kOpenBlas, d, s.ta, s.tb, a, b, c, 1, g_beta);
    case Variant::kOneDnnF32:
      return foldpar::gemm_f32(GemmEngine::kOneDnn, d, s.ta, s.tb, a, b, c, 1, g_beta);
    case Variant::kSkinny:
      return foldpar::gemm_f32(GemmEngine::kSkinny, d, s.ta, s.tb, a, b, c, 1, g_beta);
    case Variant::kOneDnnBf16:
      return foldpar::gemm_bf16(d, s.ta, s.tb, o.a16.data() + i * s.m * s.k, o.b16.data() + i * s.k * s.n,
                                foldpar::DType::kF32, c, 1, g_beta);
  }
}

// GFLOP/s of repeated calls for at least `budget` seconds (one warm call first).
double time_gflops(Variant v, const Shape& s, Operands& o, double budget) {
  run_once(v, s, o);
  int calls = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double dt = 0;
  do {
    run_once(v, s, o);
    ++calls;
    dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (dt < budget);
  return 2.0 * static_cast<double>(s.m) * s.n * s.k * calls / dt / 1e9;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

const char* arg(int argc, char** argv, const char* flag, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], flag) == 0) return argv[i + 1];
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string model = arg(argc, argv, "--model", "configs/small.json");
  const int64_t tokens = std::atoll(arg(argc, argv, "--tokens", "1024"));
  const int rounds = std::atoi(arg(argc, argv, "--rounds", "7"));
  const int threads = std::atoi(arg(argc, argv, "--threads", "1"));
  const double budget = std::atof(arg(argc, argv, "--seconds", "0.05"));
  g_beta = static_cast<float>(std::atof(arg(argc, argv, "--beta", "0")));
  const double cold_mib = std::atof(arg(argc, argv, "--cold-mib", "0"));
  foldpar::Result<foldpar::LlamaConfig> config = foldpar::LlamaConfig::load(model);
  if (!config.ok() || tokens <= 0 || rounds <= 0 || threads <= 0 || !(cold_mib >= 0)) {
    std::fprintf(stderr, "gemm_engine_bench: %s\n",
                 config.ok() ? "--tokens, --rounds and --threads must be positive, --cold-mib not negative"
                             : config.status().to_string().c_str());
    return 2;
  }
  foldpar::set_gemm_threads(threads);
  const foldpar::GemmEngineReport& rep = foldpar::gemm_engine_report();
  std::printf("%s\n", rep.summary().c_str());
  if (!rep.warning.empty()) std::printf("warning: %s\n", rep.warning.c_str());
  std::printf("model %s, T = %lld tokens, %d threads, %d interleaved rounds, beta %g, %s, medians in GFLOP/s\n",
              model.c_str(), static_cast<long long>(tokens), threads, rounds, g_beta,
              cold_mib > 0 ? fmt::format("cold operands (copies over {} MiB)", cold_mib).c_str() : "warm operands");

  const std::vector<Shape> shapes = shapes_of(*config, tokens);
  std::vector<Operands> ops;
  for (const Shape& s : shapes) ops.push_back(make_operands(s, cold_mib));
  auto variants_of = [&](const Shape& s) {
    std::vector<Variant> v = {Variant::kOpenBlas, Variant::kOneDnnF32};
    if (!s.ta && s.m <= 4) v.push_back(Variant::kSkinny);
    v.push_back(Variant::kOneDnnBf16);
    return v;
  };
  // rates[shape][variant]: one entry per round
  std::vector<std::vector<std::vector<double>>> rates(shapes.size(), std::vector<std::vector<double>>(4));
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < shapes.size(); ++i)
      for (Variant v : variants_of(shapes[i]))
        rates[i][static_cast<int>(v)].push_back(time_gflops(v, shapes[i], ops[i], budget));

  std::printf("%-22s %5s %5s %5s | %9s %10s %8s %11s | %7s %7s | %-10s %s\n", "shape", "m", "n", "k", "openblas",
              "onednn f32", "skinny", "onednn bf16", "f32/ob", "bf16/ob", "auto f32", "onednn impl f32 / bf16");
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    const MatmulDims d = dims_of(s);
    auto med = [&](Variant v) { return rates[i][static_cast<int>(v)].empty() ? 0.0 : median(rates[i][static_cast<int>(v)]); };
    const double ob = med(Variant::kOpenBlas), dn = med(Variant::kOneDnnF32), sk = med(Variant::kSkinny),
                 bf = med(Variant::kOneDnnBf16);
    const std::string impl_f32 = foldpar::onednn_impl_name(d, s.ta, s.tb, foldpar::DType::kF32, foldpar::DType::kF32, g_beta);
    const std::string impl_bf16 = foldpar::onednn_impl_name(d, s.ta, s.tb, foldpar::DType::kBF16, foldpar::DType::kF32, g_beta);
    std::printf("%-22s %5lld %5lld %5lld | %9.1f %10.1f %8s %11.1f | %7.2f %7.2f | %-10s %s / %s\n", s.name.c_str(),
                static_cast<long long>(s.m), static_cast<long long>(s.n), static_cast<long long>(s.k), ob, dn,
                sk > 0 ? fmt::format("{:.1f}", sk).c_str() : "-", bf, dn / ob, bf / ob,
                foldpar::gemm_engine_name(foldpar::choose_f32_engine(d, s.ta, s.tb)), impl_f32.c_str(),
                impl_bf16.c_str());
  }
  return 0;
}
