#!/usr/bin/env bash
# Sets up, builds and runs the main job: `foldpar verify` on configs/small.json (fast path
# against the fp64 reference, loss and every gradient), the same model under TSP on two
# ranks against the single-rank model, then a short single-rank training step timing.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
export OPENBLAS_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "== foldpar verify --model configs/small.json"
./build/tools/foldpar verify --model configs/small.json
echo
echo "== mpirun -np 2 foldpar verify --model configs/small.json --layout tsp=2 --seq 1024"
mpirun -np 2 ./build/tools/foldpar verify --model configs/small.json --layout tsp=2 --seq 1024 | tail -5
echo
echo "== foldpar bench --model configs/small.json --seq 1024 (one thread, forward + backward)"
./build/tools/foldpar bench --model configs/small.json --seq 1024 --steps 3
