// GPU benchmark (built only with FOLDPAR_WITH_CUDA): bf16 GEMM, causal flash attention
// forward and backward at d = 128 and d = 64 (the default kernel choice, tensor cores for
// bf16, then the simple reference kernel at d = 128: keys *_simple_tflops), and training
// steps of configs/small.json and configs/llama-1b.json through run_training, the code path
// of `foldpar train --device cuda` (bf16 weights with f32 masters, the trainer's gradient norm
// and one-launch AdamW). Inputs are random normal values (constant fills would flatter the
// GEMMs' power draw and the softmax). Prints one "RESULT <key> <value>" line per figure
// (scripts/gpu-check.sh tabulates them). Reports, never asserts; skips with a message and
// exits 0 where no GPU is visible.
//
// FLOP conventions: GEMM 2*M*N*K; attention counts visible (causal) pairs only, 4*d per
// pair per head forward and 2.5x that backward (FlashAttention's convention); the training
// step uses model/flop_count.h (the model's FLOPs, no recompute). MFU = step FLOP/s / peak
// bf16 dense (989 TFLOP/s for an H200 SXM unless --peak-tflops says otherwise).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "bench_cli.h"
#include "comm/nccl/device_communicator.h"
#include "comm/self_communicator.h"
#include "core/rng.h"
#include "core/timing.h"
#include "data/corpus.h"
#include "layout/layout.h"
#include "model/flop_count.h"
#include "train/trainer.h"

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

// A device tensor of `shape` in `dtype` holding scale * normal(seed) values, made on the host
// and crossing once (f32), then converted on the device.
Tensor random_device(CudaBackend& be, const Shape& shape, DType dtype, uint64_t seed, double scale) {
  Tensor f32 = Tensor::empty(shape, DType::kF32, MemCategory::kWorkspace);
  std::vector<float> host(static_cast<size_t>(f32.numel()));
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(scale * normal_at(seed, 0, i));
  be.copy_from_host(std::as_bytes(std::span<const float>(host)), f32);
  if (dtype == DType::kF32) return f32;
  Tensor out = Tensor::empty(shape, dtype, MemCategory::kWorkspace);
  be.copy(f32, out);
  return out;
}

void bench_gemm(CudaBackend& be, int64_t n) {
  Tensor a = random_device(be, {n, n}, DType::kBF16, 1, 1.0);
  Tensor b = random_device(be, {n, n}, DType::kBF16, 2, 1.0);
  Tensor c = Tensor::empty({n, n}, DType::kBF16, MemCategory::kWorkspace);
  be.fill(0, c);
  const double t = time_per_call(be, 3, 10, [&] { be.matmul(a, false, b, true, c); });
  std::printf("gemm bf16 %lld^3 (A B^T, f32 accumulation): %.3f ms\n", static_cast<long long>(n), t * 1e3);
  result("gemm_bf16_tflops", 2.0 * n * n * n / t / 1e12);
}

// Keys attention_{fwd,bwd}<key_suffix>_tflops.
void bench_attention(CudaBackend& be, int64_t seq, int64_t n_h, int64_t d, const std::string& key_suffix) {
  const int64_t B = 1, n_kv = n_h / 4;
  // Random q, k, v, dO: scores of unit scale after 1/sqrt(d), so the softmax is neither flat
  // nor one-hot.
  Tensor q = random_device(be, {B, seq, n_h, d}, DType::kBF16, 11, 1.0);
  Tensor k = random_device(be, {B, seq, n_kv, d}, DType::kBF16, 12, 1.0);
  Tensor v = random_device(be, {B, seq, n_kv, d}, DType::kBF16, 13, 1.0);
  Tensor o = Tensor::empty(q.shape(), DType::kBF16, MemCategory::kActivations);
  Tensor d_o = random_device(be, q.shape(), DType::kBF16, 14, 1.0);
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

// A corpus for the training steps: pseudo-random lowercase words (bytes tokenizer), enough
// for `tokens` training tokens and validation windows of `seq` + 1 tokens, prepared in `dir`.
Status prepare_bench_corpus(const std::filesystem::path& dir, int64_t tokens, int64_t seq) {
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir / "text");
    Rng rng(7);
    int64_t written = 0;
    // Documents of about 2 KB; every 50th is held out, so 1.2x the training tokens leaves a
    // validation set of several thousand tokens at least, and 120 (S + 1) bytes one of about
    // two windows of S + 1 (llama-1b at S = 4096 needed that).
    const int64_t bytes = std::max(tokens + tokens / 5 + 200000, 120 * (seq + 1));
    for (int64_t doc = 0; written < bytes; ++doc) {
      std::string line;
      while (line.size() < 2000) {
        const uint64_t len = 2 + rng.below(8);
        for (uint64_t i = 0; i < len; ++i) line.push_back(static_cast<char>('a' + rng.below(26)));
        line.push_back(' ');
      }
      f << line << "\n%\n";
      written += static_cast<int64_t>(line.size()) + 3;
    }
  }
  PrepareOptions prep;
  prep.inputs = {(dir / "text").string()};
  prep.out_dir = (dir / "data").string();
  prep.tokenizer = "bytes";
  return prepare_corpus(prep).status();
}

// Training steps through run_training, as `foldpar train --device cuda --layout tsp=1` runs
// them (bf16 storage with f32 masters, the default there): the trainer's median step time
// over `steps` steps, which the first step's warm-up (the pool's first allocations,
// cuBLAS's plans) does not move.
Status bench_train_step(CudaBackend& be, const std::string& key, const LlamaConfig& c, int64_t batch, int64_t seq,
                        const Flags& f) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("foldpar_gpu_bench_" + std::to_string(getpid()) + "_" + key);
  const int64_t steps = f.quick ? 3 : 6;
  FP_RETURN_IF_ERROR(prepare_bench_corpus(dir, steps * batch * seq, seq));
  TrainOptions o;
  o.config = c;
  FP_ASSIGN_OR_RETURN(Layout layout, parse_layout("tsp=1:bf16"));
  o.layout = layout;
  o.data_dir = (dir / "data").string();
  o.seq = seq;
  o.batch = batch;
  o.steps = steps;
  o.eval_every = 0;
  o.eval_batches = 1;
  o.final_checkpoint = false;  // a llama-1b checkpoint is 13 GB of f32 masters and moments
  o.print_every = 0;
  o.out_dir = (dir / "run").string();
  o.backend = &be;
  // The mesh's axes as `train --device cuda` makes them (tools/cuda_device.cc): device
  // communicators ordered after the compute stream. A host communicator would copy device
  // memory on the host.
  const DeviceCommOptions comm{.device = 0, .compute_stream = be.stream()};
  o.axis_comm = [comm](Communicator& host) { return make_device_communicator(host, comm); };
  SelfCommunicator world("world", 0);
  Result<TrainReport> r = run_training(o, world);
  std::error_code ec;
  fs::remove_all(dir, ec);
  FP_RETURN_IF_ERROR(r.status());
  const double tps = r->tokens_per_second;
  const double flops_per_token = train_step_flops(c, batch, seq) / static_cast<double>(batch * seq);
  std::printf("train step %s B=%lld S=%lld via run_training (bf16 weights, f32 masters and moments), %lld steps: "
              "%.0f tokens/s (median), loss %.3f -> %.3f\n",
              key.c_str(), static_cast<long long>(batch), static_cast<long long>(seq), static_cast<long long>(steps),
              tps, r->losses.front(), r->losses.back());
  result((key + "_tokens_per_s").c_str(), tps);
  result((key + "_mfu_percent").c_str(), 100.0 * tps * flops_per_token / (f.peak_tflops * 1e12));
  return Status();
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
    bench_attention(*be, f.quick ? 2048 : 8192, 32, 64, "_d64");
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
    CudaBackendOptions opt;
    auto be = make_cuda_backend(opt);
    if (Status st = bench_train_step(*be, key, *c, batch, seq, f); !st.ok()) {
      std::printf("gpu_bench: train step %s: %s\n", key.c_str(), st.to_string().c_str());
      return 2;
    }
  }
  return 0;
}

}  // namespace
}  // namespace foldpar

int main(int argc, char** argv) {
  // Line by line: a crash must not swallow the figures already measured (stdout is a file
  // under scripts/gpu-check.sh).
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  foldpar::Flags f;
  CLI::App app{"GPU benchmark: bf16 GEMM, flash attention and a training step on the CUDA backend", "gpu_bench"};
  app.add_flag("--quick", f.quick, "smaller sizes, for a smoke run");
  app.add_option("--peak-tflops", f.peak_tflops, "bf16 dense peak of the device, for the MFU")->check(foldpar::bench::kPositive);
  app.add_option("--configs", f.config_dir, "directory holding small.json and llama-1b.json");
  if (std::optional<int> rc = foldpar::bench::parse_flags(app, argc, argv)) return *rc;
  return foldpar::run(f);
}
