// GPU benchmark (built only with FOLDPAR_WITH_CUDA): bf16 GEMM, causal flash attention
// forward and backward (the default kernel choice, tensor cores for bf16, then the simple
// reference kernel: keys *_simple_tflops), and a training step (forward + backward + AdamW)
// of the model on the CUDA backend for configs/small.json and configs/llama-1b.json. Prints one
// "RESULT <key> <value>" line per figure (scripts/gpu-check.sh tabulates them). Reports,
// never asserts; skips with a message and exits 0 where no GPU is visible.
//
// FLOP conventions: GEMM 2*M*N*K; attention counts visible (causal) pairs only, 4*d per
// pair per head forward and 2.5x that backward (FlashAttention's convention); the training
// step uses model/flop_count.h. MFU = step FLOP/s / peak bf16 dense (989 TFLOP/s for an
// H200 SXM unless --peak-tflops says otherwise).
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "app/synthetic.h"
#include "backend/cuda/cuda_backend.h"
#include "bench_cli.h"
#include "core/timing.h"
#include "model/flop_count.h"
#include "model/llama_model.h"

namespace foldpar {
namespace {

struct Flags {
  bool quick = false;           // smaller sizes, for a smoke run
  double peak_tflops = 989.0;   // bf16 dense peak of the device (H200 SXM)
  std::string config_dir = "configs";
};

// Seconds per call of fn (after `warmup` calls), the backend synchronized around.
double time_per_call(CudaBackend& be, int warmup, int iters, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  be.synchronize();
  const double t0 = now_seconds();
  for (int i = 0; i < iters; ++i) fn();
  be.synchronize();
  return (now_seconds() - t0) / iters;
}

void result(const char* key, double value) { std::printf("RESULT %s %.4g\n", key, value); }

void bench_gemm(CudaBackend& be, int64_t n) {
  Tensor a = Tensor::empty({n, n}, DType::kBF16, MemCategory::kWorkspace);
  Tensor b = Tensor::empty({n, n}, DType::kBF16, MemCategory::kWorkspace);
  Tensor c = Tensor::empty({n, n}, DType::kBF16, MemCategory::kWorkspace);
  be.fill(0.01, a);  // first touch on the device: the pages live there
  be.fill(0.02, b);
  be.fill(0, c);
  const double t = time_per_call(be, 3, 10, [&] { be.matmul(a, false, b, true, c); });
  std::printf("gemm bf16 %lld^3 (A B^T, f32 accumulation): %.3f ms\n", static_cast<long long>(n), t * 1e3);
  result("gemm_bf16_tflops", 2.0 * n * n * n / t / 1e12);
}

// Keys attention_{fwd,bwd}<key_suffix>_tflops.
void bench_attention(CudaBackend& be, int64_t seq, int64_t n_h, int64_t d, const std::string& key_suffix) {
  const int64_t B = 1, n_kv = n_h / 4;
  Tensor q = Tensor::empty({B, seq, n_h, d}, DType::kBF16, MemCategory::kActivations);
  Tensor k = Tensor::empty({B, seq, n_kv, d}, DType::kBF16, MemCategory::kActivations);
  Tensor v = Tensor::empty({B, seq, n_kv, d}, DType::kBF16, MemCategory::kActivations);
  Tensor o = Tensor::empty(q.shape(), DType::kBF16, MemCategory::kActivations);
  Tensor d_o = Tensor::empty(q.shape(), DType::kBF16, MemCategory::kActivations);
  Tensor dq = Tensor::empty(q.shape(), DType::kBF16, MemCategory::kActivations);
  Tensor dk = Tensor::empty(k.shape(), DType::kBF16, MemCategory::kActivations);
  Tensor dv = Tensor::empty(v.shape(), DType::kBF16, MemCategory::kActivations);
  Tensor lse = Tensor::empty({B, n_h, seq}, DType::kF32, MemCategory::kActivations);
  Tensor pos = Tensor::empty({seq}, DType::kI32, MemCategory::kActivations);
  {
    std::vector<int32_t> host(static_cast<size_t>(seq));
    for (int64_t i = 0; i < seq; ++i) host[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    be.copy_from_host(std::as_bytes(std::span<const int32_t>(host)), pos);
  }
  for (Tensor* t : {&q, &k, &v, &d_o}) be.fill(0.1, *t);
  const AttentionArgs args{&q, &k, &v, &pos, &pos, 1.0 / std::sqrt(static_cast<double>(d))};
  const double pairs = static_cast<double>(seq) * (seq + 1) / 2;
  const double fwd_flops = 4.0 * d * pairs * n_h * B;
  const double tf = time_per_call(be, 1, 3, [&] { be.attention_forward(args, o, lse); });
  const double tb = time_per_call(be, 1, 3, [&] { be.attention_backward(args, o, lse, d_o, dq, dk, dv); });
  std::printf("attention%s bf16 causal S=%lld n_h=%lld n_kv=%lld d=%lld: forward %.2f ms, backward %.2f ms\n",
              key_suffix.c_str(), static_cast<long long>(seq), static_cast<long long>(n_h),
              static_cast<long long>(n_kv), static_cast<long long>(d), tf * 1e3, tb * 1e3);
  result(("attention_fwd" + key_suffix + "_tflops").c_str(), fwd_flops / tf / 1e12);
  result(("attention_bwd" + key_suffix + "_tflops").c_str(), 2.5 * fwd_flops / tb / 1e12);
}

// Forward + backward + AdamW on bf16 weights (f32 statistics), one GPU.
void bench_train_step(const std::string& key, const LlamaConfig& c, int64_t batch, int64_t seq, const Flags& f) {
  CudaBackendOptions opt;  // ops return once enqueued: the host waits only where it reads
  auto be = make_cuda_backend(opt);
  // Initial values and the batch are made on the host (a tracker of plain host memory) and
  // cross once through copy_from_host; the f32 weights are rounded to bf16 on the device.
  MemoryTracker host;
  auto upload = [&](const Tensor& h, DType dtype, MemCategory category) {
    Tensor d = Tensor::empty(h.shape(), h.dtype(), category);
    be->copy_from_host(std::span<const std::byte>(static_cast<const std::byte*>(h.raw_data()), h.nbytes()), d);
    if (dtype == h.dtype()) return d;
    Tensor converted = Tensor::empty(h.shape(), dtype, category);
    be->copy(d, converted);
    return converted;
  };
  LlamaWeights w = LlamaWeights::allocate(c, DType::kBF16, MemCategory::kParameters);
  Batch data;
  {
    std::vector<Tensor> src;
    {
      ScopedDefaultTracker on_host(host);
      LlamaWeights w32 = LlamaWeights::allocate(c, DType::kF32, MemCategory::kWorkspace);
      init_weights({.seed = 1, .std = 0.02}, w32);
      w32.for_each([&](const std::string&, Tensor& t) { src.push_back(t); });
      const Batch h = synthetic_batch(c, batch, seq, 3);
      data.input_ids = h.input_ids;
      data.target_ids = h.target_ids;
    }
    size_t i = 0;
    w.for_each([&](const std::string&, Tensor& t) { be->copy(upload(src[i++], DType::kF32, MemCategory::kWorkspace), t); });
    data.input_ids = upload(data.input_ids, DType::kI32, MemCategory::kActivations);
    data.target_ids = upload(data.target_ids, DType::kI32, MemCategory::kActivations);
  }
  LlamaWeights g = LlamaWeights::allocate(c, DType::kBF16, MemCategory::kGradients);
  std::vector<Tensor> m, v, grads;
  g.for_each([&](const std::string&, Tensor& t) {
    grads.push_back(t);
    m.push_back(Tensor::zeros(t.shape(), DType::kF32, MemCategory::kOptimizer));
    v.push_back(Tensor::zeros(t.shape(), DType::kF32, MemCategory::kOptimizer));
  });
  auto step = [&] {
    g.for_each([&](const std::string&, Tensor& t) { be->fill(0, t); });
    Result<StepResult> r = model_forward_backward(c, *be, w, data, StepOptions{}, g);
    FP_CHECK_OK(r.status());
    Backend::AdamWStep s;
    s.lr = 1e-4;
    size_t j = 0;
    w.for_each([&](const std::string&, Tensor& p) {
      be->adamw_update(s, grads[j], p, m[j], v[j]);
      ++j;
    });
  };
  const double t = time_per_call(*be, 1, f.quick ? 1 : 3, step);
  const double tokens = static_cast<double>(batch * seq);
  const double flops = train_step_flops(c, batch, seq);
  std::printf("train step %s B=%lld S=%lld (bf16 weights, f32 statistics and moments): %.1f ms\n", key.c_str(),
              static_cast<long long>(batch), static_cast<long long>(seq), t * 1e3);
  result((key + "_tokens_per_s").c_str(), tokens / t);
  result((key + "_mfu_percent").c_str(), 100.0 * flops / t / (f.peak_tflops * 1e12));
}

int run(const Flags& f) {
  std::string why;
  if (cuda_device_count(&why) == 0) {
    std::printf("gpu_bench: skipped, no GPU: %s\n", why.c_str());
    return 0;
  }
  use_cuda_memory(MemoryTracker::process(), CudaMemory::kDevice);
  {
    CudaBackendOptions opt;  // device-only tensors between timed points
    auto be = make_cuda_backend(opt);
    bench_gemm(*be, f.quick ? 2048 : 8192);
    bench_attention(*be, f.quick ? 2048 : 8192, 16, 128, "");  // kAuto: the tensor-core kernel
  }
  {
    CudaBackendOptions opt;
    opt.attention = AttentionKernel::kSimple;
    auto be = make_cuda_backend(opt);
    bench_attention(*be, f.quick ? 2048 : 8192, 16, 128, "_simple");
  }
  for (const auto& [key, file, batch, seq] :
       std::vector<std::tuple<std::string, std::string, int64_t, int64_t>>{
           {"small", "small.json", 8, 2048}, {"llama_1b", "llama-1b.json", 1, f.quick ? 1024 : 4096}}) {
    Result<LlamaConfig> c = LlamaConfig::load(f.config_dir + "/" + file);
    if (!c.ok()) {
      std::printf("gpu_bench: %s\n", c.status().to_string().c_str());
      return 2;
    }
    bench_train_step(key, *c, batch, seq, f);
  }
  return 0;
}

}  // namespace
}  // namespace foldpar

int main(int argc, char** argv) {
  foldpar::Flags f;
  CLI::App app{"GPU benchmark: bf16 GEMM, flash attention and a training step on the CUDA backend", "gpu_bench"};
  app.add_flag("--quick", f.quick, "smaller sizes, for a smoke run");
  app.add_option("--peak-tflops", f.peak_tflops, "bf16 dense peak of the device, for the MFU")->check(foldpar::bench::kPositive);
  app.add_option("--configs", f.config_dir, "directory holding small.json and llama-1b.json");
  if (std::optional<int> rc = foldpar::bench::parse_flags(app, argc, argv)) return *rc;
  return foldpar::run(f);
}
