#!/usr/bin/env bash
# The demo's training run (configs/small.json, tsp=2, the default corpus, 200 steps of 8 x
# 256 byte tokens) must bring the validation loss below 2.6 nats/token. A uniform byte
# model scores ln 256 = 5.55; the run measured on this machine reached 2.31 (docs/
# PERFORMANCE.md), so 2.6 leaves a margin for another seed of the noise without accepting
# a model that did not learn.
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" prepare-data --out "$tmp/data" >/dev/null
"$mpirun" --allow-run-as-root -np 2 "$bin" train --model "$src/configs/small.json" --layout tsp=2 --data "$tmp/data" \
  --out "$tmp/run" --steps 200 --seq 256 --batch 8 --lr 1e-3 --warmup 20 --eval-every 100 --eval-batches 4 \
  --progress none
/usr/bin/python3 - "$tmp/run/metrics.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
val = [l["val_loss"] for l in lines if "val_loss" in l]
assert len(lines) == 200 and val, (len(lines), val)
print(f"validation loss after 200 steps: {val[-1]:.4f} (threshold 2.6)")
assert val[-1] < 2.6, f"validation loss {val[-1]:.4f} is not below 2.6"
PY
