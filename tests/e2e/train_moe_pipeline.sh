#!/usr/bin/env bash
# A mixture-of-experts model (configs/tiny-moe.json, Mixtral-shaped, aux loss on) under pp on
# TSP stages: pp=2,tsp=2 (four ranks, two micro-batches of two sequences, 1F1B) gives the
# one-rank run's 20 losses within 2e-5 with the same micro-batches (each its own aux loss),
# step 1's aux term within 2e-5 and expert load exactly (later steps' aux within 1e-3: a
# near-tied token may route differently once the weights differ in their last bits); its step-10 checkpoint
# resumes on tsp=2 (the experts resharded from two stages onto one) and continues with the
# one-rank losses; pp=2,tsp=1 under the interleaved schedule (the same model with four
# layers, one per chunk) follows its one-rank run too, and zb is refused by name. On Megatron
# stages: pp=2,sp=2 (the experts over the sp ranks of each stage) follows the one-rank losses
# likewise and its step-10 checkpoint resumes on tp=2. Greedy generation from the one-rank
# checkpoint gives the same completions on pp=2,tsp=2, pp=2,tsp=1 and pp=2,tp=2.
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
train() {  # train OUT [flags]; NP ranks (1)
  local out=$1; shift
  "$mpirun" --allow-run-as-root --oversubscribe -np "${NP:-1}" "$bin" train --model "${MODEL:-$src/configs/tiny-moe.json}" \
    --data "$tmp/data" --out "$out" --steps 20 --seq 64 --batch 4 --micro-batch 2 --lr 3e-3 --warmup 2 \
    --eval-every 0 --eval-batches 1 --progress none --seed 3 --checkpoint-every 10 "$@"
}
"$bin" prepare-data --out "$tmp/data" >/dev/null
train "$tmp/one" >/dev/null
NP=4 train "$tmp/pp" --layout pp=2,tsp=2 --stop-after 10 >/dev/null
NP=2 train "$tmp/pp" --layout tsp=2 --resume >/dev/null  # the pp=2,tsp=2 checkpoint resharded onto tsp=2
NP=4 train "$tmp/ppsp" --layout pp=2,sp=2 --stop-after 10 >/dev/null
NP=2 train "$tmp/ppsp" --layout tp=2 --resume >/dev/null  # experts from two stages' sp ranks onto tp=2
/usr/bin/python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["num_hidden_layers"] = 4; json.dump(c, open(sys.argv[2], "w"))' \
  "$src/configs/tiny-moe.json" "$tmp/four.json"
MODEL=$tmp/four.json train "$tmp/one4" --stop-after 6 >/dev/null
MODEL=$tmp/four.json NP=2 train "$tmp/ppi" --layout pp=2,tsp=1 --schedule interleaved:2 --stop-after 6 >/dev/null
if NP=2 train "$tmp/zb" --layout pp=2,tsp=1 --schedule zb --stop-after 1 >/dev/null 2>"$tmp/zb.err"; then
  echo "FAIL: zb with a MoE model ran" >&2
  exit 1
fi
grep -qF "does not split a mixture-of-experts layer's backward" "$tmp/zb.err" || { cat "$tmp/zb.err" >&2; exit 1; }
# Generation under pp routes each new token on its stage's experts: the same greedy completions
# as one rank, in flight (B = 3 >= p) and step by step.
gen() {  # gen NP OUT [flags]
  local np=$1 out=$2; shift 2
  "$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$bin" generate --checkpoint "$tmp/one" --prompt "The " \
    --prompt "Q: What is" --prompt "A" --max-new-tokens 12 --json "$@" >"$out" 2>/dev/null
}
gen 1 "$tmp/gen1.jsonl"
gen 4 "$tmp/genpp.jsonl" --layout pp=2,tsp=2:moe=ring
gen 2 "$tmp/genppl.jsonl" --layout pp=2,tsp=1 --lockstep
gen 4 "$tmp/genpptp.jsonl" --layout pp=2,tp=2
for f in genpp genppl genpptp; do
  cmp "$tmp/gen1.jsonl" "$tmp/$f.jsonl" || { echo "FAIL: moe greedy generation under pp differs: $f" >&2; exit 1; }
done
[ "$(wc -l <"$tmp/gen1.jsonl")" = 3 ] || { echo "FAIL: expected 3 completions" >&2; exit 1; }
/usr/bin/python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def lines(name):
    return {json.loads(l)["step"]: json.loads(l) for l in open(f"{tmp}/{name}/metrics.jsonl")}
for name, ref, steps in (("pp", "one", 20), ("ppsp", "one", 20), ("ppi", "one4", 6)):
    run, one = lines(name), lines(ref)
    assert set(range(1, steps + 1)) <= set(run), (name, sorted(run))
    for step in range(1, steps + 1):
        a, b = run[step], one[step]
        assert abs(a["loss"] - b["loss"]) <= 2e-5 * b["loss"], (name, step, a, b)
        # Step 1 (the same weights): the same routing, the aux term within 2e-5. Later the
        # weights differ in their last bits and a near-tied token may pick another expert (one
        # token of the load moves), which moves the aux term by ~1e-5 of itself: 1e-3 then.
        assert abs(a["aux_loss"] - b["aux_loss"]) <= (2e-5 if step == 1 else 1e-3) * b["aux_loss"], (name, step, a, b)
        if step == 1:
            assert a["expert_load"] == b["expert_load"], (name, a, b)
    assert sum(run[1]["expert_load"]) == 4 * 64 * 2 * (4 if name == "ppi" else 2), run[1]
print("moe under pp=2,tsp=2 (resumed on tsp=2 after step 10), pp=2,sp=2 (resumed on tp=2) and "
      "pp=2,tsp=1:interleaved=2 matches the one-rank run within 2e-5 (loss, aux term), the expert load exactly; "
      "zb refused by name; greedy generation under pp (tsp and tp stages) equals one rank's")
PY
