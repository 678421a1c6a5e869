// Stands in for the CUDA toolkit's cuda_runtime.h when a kernel file (.cu) and the backend's
// own headers (cuda_common.cuh, cuda_kernels.h) compile as host C++ for the emulation:
// shim.h's threads and warps, plus the few runtime calls the elementwise launchers make,
// done at once on host memory (there is one stream, and it is the calling thread).
#pragma once
#define FP_SHIM_CORE_ONLY
#include "shim.h"

#include <mutex>

using cudaError_t = int;
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDefault };
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t) {
  memcpy(dst, src, bytes);
  return 0;
}
inline cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t) {
  memset(dst, value, bytes);
  return 0;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return 0; }
// The threads of a block run at once: atomics take a lock.
inline std::mutex& atomic_mutex() {
  static std::mutex mu;
  return mu;
}
inline double atomicAdd(double* p, double v) {
  std::lock_guard<std::mutex> lock(atomic_mutex());
  const double old = *p;
  *p = old + v;
  return old;
}
inline float __expf(float x) { return expf(x); }
