#!/usr/bin/env python3
"""Makes the tensor-core flash attention (src/backend/cuda/flash_attention_tc.cu) compile as
host C++ against shim.h: the inline-PTX helpers are dropped (the shim emulates mma.sync,
ldmatrix and cp.async), dynamic shared memory points at the shim's block buffer, and each
<<<grid, block, smem, stream>>> launch becomes emulate_launch(kernel, grid, block, smem,
stream, ...). Fails loudly when the kernel file no longer has the shape this expects, so a
change to the kernel cannot silently skip the emulation test.
Usage: transform.py <flash_attention_tc.cu> <output .inc>"""
import re
import sys

src_path, out_path = sys.argv[1], sys.argv[2]
src = open(src_path).read()
src = src.replace('#include "backend/cuda/cuda_common.cuh"', '#include "shim.h"')
start = src.index('__device__ __forceinline__ void mma_16816')
end = src.index('__device__ __forceinline__ uint32_t pack_bf16')
src = src[:start] + src[end:]
smem = 'extern __shared__ __align__(16) unsigned char smem_bytes[];'
if smem not in src:
    sys.exit(f"transform.py: '{smem}' not found in {src_path}: update the emulation")
src = src.replace(smem, 'unsigned char* smem_bytes = g_smem;')
src, n = re.subn(r'(\w+)<<<(.*?)>>>\(', r'emulate_launch(\1, \2, ', src, flags=re.S)
if n != 3:
    sys.exit(f"transform.py: expected 3 kernel launches in {src_path}, found {n}: update the emulation")
open(out_path, 'w').write(src)
