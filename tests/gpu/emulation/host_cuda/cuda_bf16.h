// Stands in for the CUDA toolkit's cuda_bf16.h in the emulation (host_cuda/cuda_runtime.h):
// shim.h's __nv_bfloat16 bits, converted as foldpar's host code converts (round to nearest
// even, tensor/dtype.h), which is what __float2bfloat16_rn does on the GPU.
#pragma once
#include <cuda_runtime.h>
#include "tensor/dtype.h"

inline float __bfloat162float(__nv_bfloat16 b) { return foldpar::bf16_to_f32(foldpar::bf16{b.bits}); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {foldpar::f32_to_bf16(f).bits}; }
