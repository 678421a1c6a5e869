#!/usr/bin/env bash
# Sets up (Debian packages), builds and runs the whole test suite through ctest (build/),
# then the unit and MPI tests again under AddressSanitizer + UndefinedBehaviorSanitizer
# (build-asan/). CI runs exactly this.
# Usage: ./scripts/test.sh [--no-sanitize | --sanitize-only] [ctest arguments...]
#   --no-sanitize    only the normal suite          e.g. ./scripts/test.sh --no-sanitize -L unit
#   --sanitize-only  only the sanitizer pass (labels unit and parallel)
# ctest arguments apply to every pass run.
set -euo pipefail
cd "$(dirname "$0")/.."
normal=1 sanitize=1
case "${1:-}" in
  --no-sanitize) sanitize=0; shift ;;
  --sanitize-only) normal=0; shift ;;
esac
./scripts/setup.sh
# MPI as root (CI runs as root) and one BLAS thread per process: ranks share the cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1

# Tests declare the processes they start (ctest PROCESSORS), so ctest may run several at once.
jobs=$(nproc)

if [ "$normal" = 1 ]; then
  # The CUDA code is compiled and linked wherever the toolkit is (it needs no GPU to build),
  # so that it never rots; its tests (label gpu) skip, with the reason, where no GPU is.
  cuda=()
  if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
    cuda=(-DFOLDPAR_WITH_CUDA=ON)
  else
    echo "test: no CUDA toolkit (nvcc): the GPU backend is not built" >&2
  fi
  ./scripts/build.sh "${cuda[@]}"
  # Label bundle (the GPU machine's build against gpu-bundle/, scripts/gpu-bundle-check.sh)
  # builds foldpar with CUDA a second time, about 15 minutes here: run it on purpose with
  # `ctest --test-dir build -L bundle` until it fits the suite's time.
  ctest --test-dir build --output-on-failure --timeout 900 -j "$jobs" -LE bundle "$@"
fi

if [ "$sanitize" = 1 ]; then
  # -O1 -g1 (the build type "Sanitize"): line numbers in reports, and half the compile time
  # of -O2 -g; the test programs' own code at -O0 (cmake/flags.cmake, FOLDPAR_GLUE). Only the test programs are built: the e2e tests (the program under real
  # workloads) and the benchmarks stay with the normal pass.
  . scripts/ccache-env.sh
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Sanitize -DCMAKE_CXX_FLAGS_SANITIZE=-O1 \
    -DFOLDPAR_SANITIZE=address,undefined -DFOLDPAR_BUILD_BENCH=OFF "${ccache_flags[@]}" >/dev/null
  cmake --build build-asan --target foldpar_test_programs
  # OpenMPI does not free everything at exit, so leak checking is off; any other report,
  # and any undefined behaviour, fails the test. The MPI tests run here at 2, 3 and 4 ranks;
  # their one-rank entries (every one of them also runs at 2 or more), the 2-rank entries of
  # programs that also run at 4 ranks (label sanitize_covered), and the watchdog's failure
  # driver (timeouts and aborts of whole jobs: waiting, not computing) stay with the normal
  # pass, for CI's time.
  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure --timeout 900 -j "$jobs" -L 'unit|parallel' \
    -LE sanitize_covered -E '^parallel\..*\.np1$|^parallel\.comm_failure_test$' "$@"
fi
