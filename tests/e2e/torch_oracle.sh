#!/usr/bin/env bash
# foldpar's loss, logits and every gradient against an independent PyTorch implementation
# (scripts/torch_reference.py, fp64), for untied and tied embeddings and GQA.
set -euo pipefail
bin=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" verify --model "$src/configs/tiny.json" --batch 2 --seq 80 --seed 3 --dump "$tmp/untied" >/dev/null
sed 's/"tie_word_embeddings": false/"tie_word_embeddings": true/' "$src/configs/tiny.json" >"$tmp/tied.json"
"$bin" verify --model "$tmp/tied.json" --batch 1 --seq 33 --seed 4 --dump "$tmp/tied" >/dev/null
# Both dumps against PyTorch in one process (one import of torch).
/usr/bin/python3 "$src/tests/e2e/torch_oracle_many.py" "$src" "$tmp/untied" "$tmp/tied"
