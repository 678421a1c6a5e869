// The fast backend's matmul (OpenBLAS sgemm behind Backend::matmul) on the shapes of a
// training step, single thread, in GFLOP/s beside sgemm 2048^3 measured in the same run.
// Usage: matmul_bench [--model configs/small.json] [--tokens 1024,4096] [--reps 9]
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.h"
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
  be.matmul(a, s.ta, b, s.tb, c);
  std::vector<double> secs;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    be.matmul(a, s.ta, b, s.tb, c);
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * static_cast<double>(s.m * s.n * s.k) / bench::median(secs) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "configs/small.json";
  std::vector<int64_t> tokens = {1024, 4096};
  int reps = 9;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--model") {
      model = v;
    } else if (a == "--tokens") {
      tokens.clear();
      std::stringstream ss(v);
      for (std::string item; std::getline(ss, item, ',');) tokens.push_back(std::stoll(item));
    } else if (a == "--reps") {
      reps = std::stoi(v);
    } else {
      std::fprintf(stderr, "matmul_bench: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
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
  std::printf("sgemm 2048^3 again: %.1f GFLOP/s\n", bench::sgemm_gflops());
  return 0;
}
