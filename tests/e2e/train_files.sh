#!/usr/bin/env bash
# The files around training: a writer killed in the middle of a checkpoint is never loaded
# (the previous checkpoint is), export to a Hugging Face directory and import from one, and
# plots drawn by gnuplot.
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
train() {  # train NP LAYOUT OUT [flags]
  local np=$1 layout=$2 out=$3; shift 3
  "$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$bin" train --model "$src/configs/tiny.json" \
    --data "$tmp/data" --out "$out" --layout "$layout" --steps "${STEPS:-12}" --seq 64 --batch 4 --eval-every 0 \
    --eval-batches 1 --progress none --seed 3 "$@"
}
"$bin" prepare-data --out "$tmp/data" >/dev/null

# Checkpoints at 4 and 8; the last rank is killed while writing step 8's.
if FOLDPAR_FAULT_KILL_CHECKPOINT=8 train 2 tsp=2 "$tmp/killed" --checkpoint-every 4 >"$tmp/killed.log" 2>&1; then
  echo "the job with a killed rank exited 0" >&2
  exit 1
fi
grep -q "fault injection" "$tmp/killed.log"
test -d "$tmp/killed/checkpoints/step-00000004"
test ! -d "$tmp/killed/checkpoints/step-00000008"
# Resume picks step 4 (the incomplete step 8 is ignored, then overwritten), and the losses
# from there equal an undisturbed run's.
train 2 tsp=2 "$tmp/killed" --checkpoint-every 4 --resume >/dev/null
train 2 tsp=2 "$tmp/clean" --checkpoint-every 4 >/dev/null
/usr/bin/python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def losses(name):
    return {json.loads(l)["step"]: json.loads(l)["loss"] for l in open(f"{tmp}/{name}/metrics.jsonl")}
clean, killed = losses("clean"), losses("killed")
assert set(range(1, 13)) <= set(killed), sorted(killed)
for step in range(5, 13):
    assert killed[step] == clean[step], (step, killed[step], clean[step])
print("resumed after the killed writer: steps 5-12 identical to an undisturbed run")
PY
test -d "$tmp/killed/checkpoints/step-00000012"
ls -a "$tmp/killed/checkpoints" | grep -q incomplete && { echo "an incomplete checkpoint was left behind" >&2; exit 1; }

# Export the final checkpoint, check it with PyTorch's reader (the oracle's), import it.
"$bin" export --checkpoint "$tmp/clean/checkpoints/step-00000012" -o "$tmp/hf" >/dev/null
# A training directory means its newest complete checkpoint: the same step, the same bytes.
"$bin" export --checkpoint "$tmp/clean" -o "$tmp/hf_latest" | grep -qF "exported step 12 of $tmp/clean/checkpoints/step-00000012"
cmp "$tmp/hf/model.safetensors" "$tmp/hf_latest/model.safetensors"
/usr/bin/python3 - "$tmp/hf" "$src/scripts" <<'PY'
import sys
sys.path.insert(0, sys.argv[2])
import torch_reference as tr
tensors = tr.read_safetensors(sys.argv[1] + "/model.safetensors")
assert "model.layers.1.mlp.down_proj.weight" in tensors and "lm_head.weight" in tensors, sorted(tensors)[:5]
print(f"exported {len(tensors)} tensors")
PY
"$mpirun" --allow-run-as-root -np 1 "$bin" import --hf "$tmp/hf" -o "$tmp/imported" >/dev/null
STEPS=13 train 2 tsp=2 "$tmp/imported" --resume >/dev/null
test -d "$tmp/imported/checkpoints/step-00000013"

# Plots.
"$bin" plot "$tmp/clean/metrics.jsonl" -o "$tmp/plots" >/dev/null
for f in loss throughput memory; do
  head -c 8 "$tmp/plots/$f.png" | od -An -c | grep -q "P   N   G" || { echo "$f.png is not a PNG" >&2; exit 1; }
done
echo "plots drawn"

# Bad numbers: a learning rate that blows the weights up stops the run at the first
# non-finite gradient, naming step, tensor and rank, before the update and before any
# checkpoint of that step; the previous checkpoint stays the newest. Exit 4: a diverged run.
rc=0
train 2 tsp=2 "$tmp/nan" --lr 1e8 --warmup 0 --grad-clip 0 --checkpoint-every 1 >"$tmp/nan.log" 2>&1 || rc=$?
if [ "$rc" != 4 ]; then
  echo "training with non-finite gradients exited $rc, expected 4 (diverged)" >&2
  cat "$tmp/nan.log" >&2
  exit 1
fi
grep -q "step 2: non-finite gradients on rank(s) 0, 1: the gradient of layers.0.attn" "$tmp/nan.log"
test "$(ls "$tmp/nan/checkpoints")" = "step-00000001"
echo "non-finite gradients stopped the run at step 2"
