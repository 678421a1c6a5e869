#!/usr/bin/env bash
# Sets up (Debian packages), builds and runs the whole test suite through ctest.
# Usage: ./scripts/test.sh [ctest arguments...], e.g. ./scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
# MPI as root (CI runs as root) and one BLAS thread per process: ranks share the cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
ctest --test-dir build --output-on-failure --timeout 900 "$@"
