// The CUDA backend: every Backend op on one GPU, on one compute stream. cuBLAS GEMMs (f32
// with f32 compute, or bf16 storage with f32 accumulation, CUBLAS_COMPUTE_32F), kernels for
// the rest (backend/cuda/*.cu), causal flash attention with position arrays and GQA (on
// tensor cores for bf16, else the simple reference kernel: CudaBackendOptions::attention).
// Float tensors may be f32 or bf16 (bf16 natively: no widened copies); per-row statistics
// (RMSNorm's rstd, the log-sum-exps) must then be f32, as stat_dtype() prescribes.
//
// Memory: tensors are ordinary foldpar Tensors whose storage is CUDA device memory
// (use_cuda_memory below): host code reaches their bytes only through Backend ops
// (copy_from_host/copy_to_host, the scalar-returning reductions) and Tensor's explicit
// set-up copies, which is what the guarded stand-in (tensor/guarded_allocator.h) proves of
// every step path on the CPU. Ops are enqueued on the compute stream and return at once;
// the host waits only where it reads (copy_to_host, sum_squares, the loss, counts), unless
// CudaBackendOptions::sync_each_op asks for a wait after every op (GPU tests that read
// pinned host memory directly). docs/GPU.md has the design.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "tensor/block_pool.h"
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
  bool sync_each_op = false;  // true: every op waits for its kernels (tests that read pinned tensors on the host)
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
};

// Aborts (library failure) when no CUDA device is usable; check cuda_device_count() first.
std::unique_ptr<CudaBackend> make_cuda_backend(const CudaBackendOptions& options = {});

// Visible CUDA devices; 0 (and *why set, when given) when the driver or devices are missing.
int cuda_device_count(std::string* why = nullptr);

// Where a tracker's blocks come from (backend/cuda/device_memory.cc): device memory
// (cudaMalloc, the program and the benchmark), or pinned, mapped host memory (cudaHostAlloc:
// kernels address it over the bus, host code reads it directly: GPU tests that compare on
// the host). Either behind a caching pool (tensor/block_pool.h); never managed memory.
enum class CudaMemory { kDevice, kPinnedHost };

// Makes `tracker` take its blocks from `kind` on the current device. Must be called before
// `tracker` has a live block (FP_CHECK); typically once at start-up on
// MemoryTracker::process(). The allocators are process-wide and never destroyed. A refused
// block becomes the tracker's out-of-memory Status with the CUDA reason.
void use_cuda_memory(MemoryTracker& tracker, CudaMemory kind = CudaMemory::kDevice);
// The pool's counters of `kind` (reserved, cached, hits, source failures).
BlockPoolStats cuda_memory_pool_stats(CudaMemory kind = CudaMemory::kDevice);

}  // namespace foldpar
