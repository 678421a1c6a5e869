#!/usr/bin/env bash
# Builds the CUDA code without running it, so that the GPU code never rots: configures
# build-cuda/ with -DFOLDPAR_WITH_CUDA=ON (nvcc, cuBLAS and NCCL from /usr/local/cuda,
# sm_90) and builds only the CUDA targets: the backend, the device communicators, the GPU
# tests, gpu_bench and the foldpar program with --device cuda (plus the CPU libraries they
# link). Needs no GPU.
# BUILD_DIR overrides the directory; extra arguments go to cmake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build-cuda}
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "build-cuda: nvcc not found (neither on PATH nor /usr/local/cuda/bin); install the CUDA toolkit" >&2
  exit 2
fi
targets=(foldpar_backend_cuda foldpar_comm_nccl
         staging_test cuda_memory_test cuda_ops_test cuda_attention_test cuda_model_test gpu_tsp_test gpu_comm_test
         gpu_bench foldpar)
start=$(date +%s)
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DFOLDPAR_WITH_CUDA=ON -DFOLDPAR_BUILD_BENCH=ON "$@" >/dev/null
cmake --build "$build_dir" --target "${targets[@]}"
echo "build-cuda: built ${#targets[@]} CUDA targets in $(( $(date +%s) - start )) s (not run: see scripts/gpu-check.sh)"
