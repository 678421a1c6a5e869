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
# One process (one import of torch): the dump must pass; a copy with two experts' gate
# matrices exchanged must fail the comparison (exit 1, not refused as bad input).
cp -r "$tmp/moe" "$tmp/swapped"
/usr/bin/python3 - "$src/scripts" "$tmp/moe" "$tmp/swapped" <<'PY'
import io, sys
sys.path.insert(0, sys.argv[1])
import torch_reference as t
good, bad = sys.argv[2], sys.argv[3]
rc = t.main([good])
assert rc == 0, f"{good}: the oracle failed it (rc {rc})"
w = t.read_safetensors(f"{bad}/model.safetensors")
a, b = "model.layers.1.block_sparse_moe.experts.0.w1.weight", "model.layers.1.block_sparse_moe.experts.1.w1.weight"
w[a], w[b] = w[b], w[a]
t.write_safetensors(f"{bad}/model.safetensors", w)
out = io.StringIO()
rc = t.main([bad], out=out)
if rc != 1:
    sys.exit(f"negative control: the oracle accepted a dump with two experts exchanged (rc {rc})\n{out.getvalue()}")
PY
echo "moe oracle: PASS (and the exchanged experts fail it)"
