// The CUDA backend: every Backend op on one GPU, on one compute stream. cuBLAS GEMMs (f32
// with f32 compute, or bf16 storage with f32 accumulation, CUBLAS_COMPUTE_32F), kernels for
// the rest (backend/cuda/*.cu), causal flash attention with position arrays and GQA (on
// tensor cores for bf16, else the simple reference kernel: CudaBackendOptions::attention).
// Float tensors may be f32 or bf16 (bf16 natively: no widened copies); per-row statistics
// (RMSNorm's rstd, the log-sum-exps) must then be f32, as stat_dtype() prescribes.
//
// Memory: tensors are ordinary foldpar Tensors whose storage is CUDA unified memory
// (use_cuda_unified_memory below), so the model, the strategies and the tests run the same
// code paths as on the CPU and may read ids and positions on the host. With
// CudaBackendOptions::sync_each_op (the default) every op returns only when its kernels
// have finished, so host code may read any result right away. docs/GPU.md has the design.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "tensor/memory_tracker.h"

namespace foldpar {

// Which flash attention kernel runs (docs/GPU.md, "The attention kernels").
enum class AttentionKernel {
  kAuto,        // tensor cores where supported (bf16, d in {64, 128}, 16-byte aligned tensors), else simple
  kTensorCore,  // flash_attention_tc.cu; an unsupported case is an error (FP_CHECK)
  kSimple,      // flash_attention.cu: the f32 CUDA-core reference kernel, every case
};

struct CudaBackendOptions {
  int device = 0;             // CUDA device ordinal; one rank per device, or several sharing one
  bool sync_each_op = true;   // false: ops return once enqueued (benchmarks that never read on the host)
  bool allow_tf32 = false;    // f32 GEMMs on TF32 tensor cores (faster, ~1e-3 relative error)
  AttentionKernel attention = AttentionKernel::kAuto;
};

// The kernel `requested` resolves to (kTensorCore or kSimple, never kAuto) for attention on
// activations of `dtype` with head dim d whose tensors are all 16-byte aligned (`aligned16`).
// kTensorCore for a case that kernel does not support fails (FP_CHECK naming the case). Pure:
// the backend's own choice, exposed for tests.
AttentionKernel resolve_attention_kernel(AttentionKernel requested, DType dtype, int64_t d, bool aligned16);

class CudaBackend : public Backend {
 public:
  // The compute stream (a cudaStream_t), for communicators that order transfers after it.
  virtual void* stream() const = 0;
  virtual int device() const = 0;
  // Waits until every op enqueued so far has finished.
  virtual void synchronize() = 0;
  // Host <-> device moves of a unified-memory tensor: prefetches its pages to this GPU (before
  // kernels use it: no page faults) or to the host (before host code reads it), enqueued on
  // the compute stream. Pure performance hints: any tensor stays valid on both sides.
  virtual void to_device(const Tensor& t) = 0;
  virtual void to_host(const Tensor& t) = 0;
};

// Aborts (library failure) when no CUDA device is usable; check cuda_device_count() first.
std::unique_ptr<CudaBackend> make_cuda_backend(const CudaBackendOptions& options = {});

// Visible CUDA devices; 0 (and *why set, when given) when the driver or devices are missing.
int cuda_device_count(std::string* why = nullptr);

// Makes `tracker` take its blocks from CUDA unified memory (cudaMallocManaged on the current
// device), so tensors are addressable from host and device. Must be called before `tracker`
// has a live block (FP_CHECK); typically once at start-up on MemoryTracker::process(). The
// allocator is process-wide and never destroyed.
void use_cuda_unified_memory(MemoryTracker& tracker);

}  // namespace foldpar
