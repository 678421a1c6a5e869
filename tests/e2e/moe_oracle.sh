#!/usr/bin/env bash
# A Mixtral-shaped MoE model (configs/tiny-moe.json: 4 experts, top 2, aux loss on) against
# the independent PyTorch implementation of Hugging Face's routing and aux loss
# (scripts/torch_reference.py, fp64): loss with aux, logits, every gradient. Negative
# control: the same dump with two experts' gate matrices exchanged must fail the oracle.
# Then with moe_capacity_factor (pairs over an expert's capacity dropped).
set -euo pipefail
bin=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" verify --model "$src/configs/tiny-moe.json" --batch 2 --seq 48 --seed 5 --dump "$tmp/moe" >/dev/null
# With foldpar's capacity limit (moe_capacity_factor 0.75: each expert keeps ceil(0.75 * 48 *
# 2 / 4) = 18 of a sequence's 96 pairs, an even share being 24), against the reference's own
# running count; the same dump read as dropless must fail (the drops change the numbers).
/usr/bin/python3 -c 'import json, sys
d = json.load(open(sys.argv[1])); d["moe_capacity_factor"] = 0.75; json.dump(d, open(sys.argv[2], "w"))' \
  "$src/configs/tiny-moe.json" "$tmp/capacity.json"
"$bin" verify --model "$tmp/capacity.json" --batch 2 --seq 48 --seed 5 --dump "$tmp/capacity" >/dev/null
grep -q '"moe_capacity_factor": 0.75' "$tmp/capacity/config.json"
cp -r "$tmp/capacity" "$tmp/dropless"
/usr/bin/python3 -c 'import json, sys
d = json.load(open(sys.argv[1])); del d["moe_capacity_factor"]; json.dump(d, open(sys.argv[1], "w"))' \
  "$tmp/dropless/config.json"
# One process (one import of torch): the dump must pass; a copy with two experts' gate
# matrices exchanged must fail the comparison (exit 1, not refused as bad input).
cp -r "$tmp/moe" "$tmp/swapped"
/usr/bin/python3 - "$src/scripts" "$tmp/moe" "$tmp/swapped" "$tmp/capacity" "$tmp/dropless" <<'PY'
import io, sys
sys.path.insert(0, sys.argv[1])
import torch_reference as t
good, bad, capacity, dropless = sys.argv[2:6]
rc = t.main([good])
assert rc == 0, f"{good}: the oracle failed it (rc {rc})"
rc = t.main([capacity])
assert rc == 0, f"{capacity}: the oracle failed the capacity-limited dump (rc {rc})"
rc = t.main([dropless], out=io.StringIO())
if rc != 1:
    sys.exit(f"negative control: the capacity-limited dump passed as dropless (rc {rc})")
w = t.read_safetensors(f"{bad}/model.safetensors")
a, b = "model.layers.1.block_sparse_moe.experts.0.w1.weight", "model.layers.1.block_sparse_moe.experts.1.w1.weight"
w[a], w[b] = w[b], w[a]
t.write_safetensors(f"{bad}/model.safetensors", w)
out = io.StringIO()
rc = t.main([bad], out=out)
if rc != 1:
    sys.exit(f"negative control: the oracle accepted a dump with two experts exchanged (rc {rc})\n{out.getvalue()}")
PY
echo "moe oracle: PASS, with a capacity limit too (and the exchanged experts and the dump read as dropless fail it)"
