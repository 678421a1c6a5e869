#!/usr/bin/env bash
# Experts over data-parallel replicas (layout ep=N, docs/composition.md section 3): a MoE model
# (configs/tiny-moe.json, 4 experts) trained on dp=2,tp=2,ep=4 and dp=2,tsp=2,ep=4 (one expert
# per rank, each expert group spanning two dp replicas) follows the one-rank run within 2e-5;
# their step-4 checkpoints resume on one rank and on tsp=2, and a tsp=2 checkpoint resumes on
# dp=2,sp=2,ep=4 (save under ep, load under another layout and the reverse); the expert-weight
# ring over the expert group (moe=ring) saves on dp=2,tsp=2,ep=4 and resumes on dp=2,tsp=1,ep=2;
# the per-expert load of step 1 is the one-rank run's exactly. Under pp (each stage's expert
# groups two dp replicas of its own): pp=2,dp=2,tsp=1,ep=2 (a2a, and the ring over each
# stage's expert group) resumed on one rank, and a one-rank
# checkpoint resumed on pp=2,dp=2,tp=1,ep=2, against one rank on the model without the aux
# term in the loss (two micro-batches per replica group rows differently from one rank's
# batch, and each micro-batch's aux loss is its own).
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
train() {  # train OUT [flags]; NP ranks (1), MODEL (tiny-moe)
  local out=$1; shift
  "$mpirun" --allow-run-as-root --oversubscribe -np "${NP:-1}" "$bin" train --model "${MODEL:-$src/configs/tiny-moe.json}" \
    --data "$tmp/data" --out "$out" --steps 8 --seq 64 --batch 4 --lr 3e-3 --warmup 2 --eval-every 0 \
    --eval-batches 1 --progress none --seed 3 --checkpoint-every 4 "$@"
}
"$bin" prepare-data --out "$tmp/data" >/dev/null
train "$tmp/clean" >/dev/null
NP=4 train "$tmp/mtp" --layout dp=2,tp=2,ep=4 --stop-after 4 >/dev/null
train "$tmp/mtp" --resume >/dev/null  # the ep checkpoint on one rank
NP=4 train "$tmp/tsp" --layout dp=2,tsp=2,ep=4 --stop-after 4 >/dev/null
NP=2 train "$tmp/tsp" --layout tsp=2 --resume >/dev/null  # ... on tsp=2
NP=2 train "$tmp/rev" --layout tsp=2 --stop-after 4 >/dev/null
NP=4 train "$tmp/rev" --layout dp=2,sp=2,ep=4 --resume >/dev/null  # a tsp=2 checkpoint under ep
# The expert-weight ring over the expert group, saved on dp=2,tsp=2,ep=4 and resumed on
# dp=2,tsp=1,ep=2 (the ring over two replicas' ranks, two experts a block).
NP=4 train "$tmp/ring" --layout dp=2,tsp=2,ep=4:moe=ring --stop-after 4 >/dev/null
NP=2 train "$tmp/ring" --layout dp=2,tsp=1,ep=2:moe=ring --resume >/dev/null
/usr/bin/python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c["output_router_logits"]=False; json.dump(c,open(sys.argv[2],"w"))' \
  "$src/configs/tiny-moe.json" "$tmp/noaux.json"
export MODEL=$tmp/noaux.json
train "$tmp/cleannoaux" >/dev/null
NP=4 train "$tmp/pp" --layout pp=2,dp=2,tsp=1,ep=2 --micro-batch 1 --stop-after 4 >/dev/null
train "$tmp/pp" --resume >/dev/null  # the pp + ep checkpoint on one rank
# ... and with the expert-weight ring over each stage's expert group.
NP=4 train "$tmp/ppring" --layout pp=2,dp=2,tsp=1,ep=2:moe=ring --micro-batch 1 --stop-after 4 >/dev/null
train "$tmp/ppring" --resume >/dev/null
train "$tmp/pprev" --stop-after 4 >/dev/null
NP=4 train "$tmp/pprev" --layout pp=2,dp=2,tp=1,ep=2 --micro-batch 1 --resume >/dev/null  # ... and the reverse
unset MODEL
/usr/bin/python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def lines(name):
    return {json.loads(l)["step"]: json.loads(l) for l in open(f"{tmp}/{name}/metrics.jsonl")}
for name, clean in (("mtp", "clean"), ("tsp", "clean"), ("rev", "clean"), ("ring", "clean"), ("pp", "cleannoaux"),
                    ("ppring", "cleannoaux"), ("pprev", "cleannoaux")):
    run, clean = lines(name), lines(clean)
    assert set(range(1, 9)) <= set(run), (name, sorted(run))
    for step in range(1, 9):
        assert abs(run[step]["loss"] - clean[step]["loss"]) <= 2e-5 * clean[step]["loss"], (name, step, run[step], clean[step])
        assert abs(run[step]["grad_norm"] - clean[step]["grad_norm"]) <= 1e-4 * clean[step]["grad_norm"], (name, step, run[step], clean[step])
    assert run[1]["expert_load"] == clean[1]["expert_load"], (name, run[1], clean[1])
print("moe with experts over dp replicas (dp=2,tp=2,ep=4; dp=2,tsp=2,ep=4; dp=2,sp=2,ep=4 resumed from tsp=2; "
      "the ring on dp=2,tsp=2,ep=4 resumed on dp=2,tsp=1,ep=2; pp=2,dp=2,tsp=1,ep=2 (a2a and ring) resumed on one rank; "
      "pp=2,dp=2,tp=1,ep=2 resumed from one rank) follows the one-rank run within 2e-5 across save and resume")
PY
