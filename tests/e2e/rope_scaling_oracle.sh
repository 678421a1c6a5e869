#!/usr/bin/env bash
# RoPE scaling (Hugging Face's linear, dynamic, llama3, yarn) against the PyTorch reference
# (scripts/torch_reference.py, fp64, the transformers formulas): loss, logits and every
# gradient on one rank, and under tsp=2 and tp=2 (their gradients assembled from the shards;
# `verify --layout` also checks them against the single-rank model). The sequence (80)
# outruns each config's pretrained context, so every type's scaling is active.
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { "$mpirun" --allow-run-as-root --oversubscribe "$@"; }
declare -A scaling=(
  [linear]='{"rope_type": "linear", "factor": 4.0}'
  [dynamic]='{"rope_type": "dynamic", "factor": 2.0}'
  [llama3]='{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}'
  [yarn]='{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8, "beta_slow": 1}'
)
for type in linear dynamic llama3 yarn; do
  /usr/bin/python3 - "$src/configs/tiny.json" "$tmp/$type.json" "${scaling[$type]}" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(max_position_embeddings=32, rope_theta=1e6, rope_scaling=json.loads(sys.argv[3]))
json.dump(c, open(sys.argv[2], "w"))
PY
  "$bin" verify --model "$tmp/$type.json" --batch 2 --seq 80 --seed 5 --dump "$tmp/$type-1" >/dev/null
  /usr/bin/python3 "$src/scripts/torch_reference.py" "$tmp/$type-1" >"$tmp/out" || { cat "$tmp/out"; exit 1; }
  for layout in tsp=2 tp=2; do
    run -np 2 "$bin" verify --model "$tmp/$type.json" --layout "$layout" --batch 2 --seq 80 --seed 5 \
      --dump "$tmp/$type-$layout" >/dev/null
    /usr/bin/python3 "$src/scripts/torch_reference.py" "$tmp/$type-$layout" >"$tmp/out" || { cat "$tmp/out"; exit 1; }
  done
  echo "rope_scaling $type: single rank, tsp=2 and tp=2 match PyTorch"
done
# The oracle itself tells the types apart: yarn's dump checked as linear must fail.
sed 's/"yarn"/"linear"/' "$tmp/yarn-1/config.json" >"$tmp/wrong.json" && mv "$tmp/wrong.json" "$tmp/yarn-1/config.json"
sed -i 's/, "beta_fast": [0-9.]*, "beta_slow": [0-9.]*//; s/"original_max_position_embeddings": 16, //' "$tmp/yarn-1/config.json"
if /usr/bin/python3 "$src/scripts/torch_reference.py" "$tmp/yarn-1" >"$tmp/out" 2>&1; then
  echo "FAIL: yarn's dump passed as linear"; cat "$tmp/out"; exit 1
fi
echo "rope_scaling_oracle: 4 types x 3 layouts match PyTorch; a wrong type is caught"
