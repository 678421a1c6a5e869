#!/usr/bin/env bash
# The TSP step (gradients assembled from every rank's shards) against PyTorch in fp64, and
# `foldpar verify --layout` against the single-rank model, at D = 2 and 4, with and without
# overlap, zigzag and contiguous.
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { "$mpirun" --allow-run-as-root --oversubscribe "$@"; }
run -np 2 "$bin" verify --model "$src/configs/tiny.json" --layout tsp=2 --seq 96 --batch 2 --dump "$tmp/d2" >/dev/null
run -np 4 "$bin" verify --model "$src/configs/tiny.json" --layout tsp=4 --seq 64 --no-overlap --seq-split contiguous \
  --dump "$tmp/d4" >/dev/null
# Both dumps against PyTorch in one process (one import of torch).
/usr/bin/python3 "$src/tests/e2e/torch_oracle_many.py" "$src" "$tmp/d2" "$tmp/d4"
grep -q '"layout": "tsp=4:contiguous:nooverlap"' "$tmp/d4/result.json"
