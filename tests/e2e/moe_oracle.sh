#!/usr/bin/env bash
# A Mixtral-shaped MoE model (configs/tiny-moe.json: 4 experts, top 2, aux loss on) against
# the independent PyTorch implementation of Hugging Face's routing and aux loss
# (scripts/torch_reference.py, fp64): loss with aux, logits, every gradient. Negative
# control: the same dump with two experts' gate matrices exchanged must fail the oracle.
set -euo pipefail
bin=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" verify --model "$src/configs/tiny-moe.json" --batch 2 --seq 48 --seed 5 --dump "$tmp/moe" >/dev/null
/usr/bin/python3 "$src/scripts/torch_reference.py" "$tmp/moe"
/usr/bin/python3 - "$src/scripts" "$tmp/moe/model.safetensors" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import torch_reference as t
w = t.read_safetensors(sys.argv[2])
a, b = "model.layers.1.block_sparse_moe.experts.0.w1.weight", "model.layers.1.block_sparse_moe.experts.1.w1.weight"
w[a], w[b] = w[b], w[a]
t.write_safetensors(sys.argv[2], w)
PY
set +e
/usr/bin/python3 "$src/scripts/torch_reference.py" "$tmp/moe" >"$tmp/neg.txt"
rc=$?
set -e
if [[ $rc -ne 1 ]]; then
  echo "negative control: the oracle accepted a dump with two experts exchanged (rc $rc)" >&2
  cat "$tmp/neg.txt" >&2
  exit 1
fi
echo "moe oracle: PASS (and the exchanged experts fail it)"
