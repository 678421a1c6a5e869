// The cuda layer: CUDA runtime support that both the CUDA backend (backend/cuda) and the
// device communicators (comm/nccl) use, so neither depends on the other. Here: the CUDA
// check macros. A failed call is a library failure (STYLE.md, errors tier 2): it prints the
// call, file:line and the library's error text through fatal_error (which adds rank and host)
// and aborts the job. The cuBLAS and NCCL macros live beside their only users
// (backend/cuda/cuda_backend.cc, comm/nccl/nccl_communicator.cc). Built only with CUDA.
#pragma once

#include <cuda_runtime.h>

#include "core/check.h"

#define FP_CUDA_CHECK(call)                                                                         \
  do {                                                                                              \
    const cudaError_t fp_cuda_rc_ = (call);                                                         \
    if (fp_cuda_rc_ != cudaSuccess) [[unlikely]]                                                    \
      ::foldpar::fatal_error(__FILE__, __LINE__, fmt::format("CUDA call failed: {}: {} ({})", #call, \
                                                             cudaGetErrorString(fp_cuda_rc_),        \
                                                             static_cast<int>(fp_cuda_rc_)));        \
  } while (0)

// After a kernel launch: reports launch-configuration errors at the launch site.
#define FP_CUDA_CHECK_LAUNCH() FP_CUDA_CHECK(cudaGetLastError())
