#!/usr/bin/env bash
# Sets up, builds and runs the main job: `foldpar verify` on configs/small.json (fast path
# against the fp64 reference, loss and every gradient), then a short single-rank training
# step timing at S = 1024.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
export OPENBLAS_NUM_THREADS=1
echo "== foldpar verify --model configs/small.json"
./build/tools/foldpar verify --model configs/small.json
echo
echo "== foldpar bench --model configs/small.json --seq 1024 (one thread, forward + backward)"
./build/tools/foldpar bench --model configs/small.json --seq 1024 --steps 3
