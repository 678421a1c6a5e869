#!/usr/bin/env bash
# The demo's training setup (configs/small.json, tsp=2, the default corpus, 8 x 256 byte tokens,
# lr 1e-3, warmup 20), cut to 60 steps to keep the suite's longest test short, must bring the
# validation loss below 2.9 nats/token. A uniform byte model scores ln 256 = 5.55; the run
# measured on this machine (2026-12-01, evaluating every 20 steps) reached 3.14, 2.83, 2.73 at
# steps 20, 40, 60, so 2.9 leaves a margin for another seed of the noise without accepting a
# model that stopped learning after 20 steps. (The demo's 120 steps reached 2.45.)
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" prepare-data --out "$tmp/data" >/dev/null
"$mpirun" --allow-run-as-root -np 2 "$bin" train --model "$src/configs/small.json" --layout tsp=2 --data "$tmp/data" \
  --out "$tmp/run" --steps 60 --seq 256 --batch 8 --lr 1e-3 --warmup 20 --eval-every 60 --eval-batches 4 \
  --progress none
/usr/bin/python3 - "$tmp/run/metrics.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
val = [l["val_loss"] for l in lines if "val_loss" in l]
assert len(lines) == 60 and val, (len(lines), val)
print(f"validation loss after 60 steps: {val[-1]:.4f} (threshold 2.9)")
assert val[-1] < 2.9, f"validation loss {val[-1]:.4f} is not below 2.9"
PY
