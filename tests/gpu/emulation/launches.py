#!/usr/bin/env python3
"""Makes a CUDA kernel file whose device code needs nothing but shim.h's threads and warps
(elementwise.cu) compile as host C++: each <<<grid, block, smem, stream>>> launch becomes
emulate_launch(kernel, grid, block, smem, stream, ...), and each __shared__ array a static
one (blocks run one after another, so a static is one block's shared memory). The headers
compile unchanged against host_cuda/. Fails loudly when the file has fewer launches than
expected, so that a change to the kernels cannot silently skip the emulation.
Usage: launches.py <kernels.cu> <output .inc> <at least this many launches>"""
import re
import sys

src_path, out_path, want = sys.argv[1], sys.argv[2], int(sys.argv[3])
src = open(src_path).read()
src, n = re.subn(r'(\w+)<<<(.*?)>>>\(', r'emulate_launch(\1, \2, ', src, flags=re.S)
if n < want:
    sys.exit(f"launches.py: expected at least {want} kernel launches in {src_path}, found {n}: update the emulation")
src = re.sub(r'__shared__\s+', 'static ', src)
open(out_path, 'w').write(src)
