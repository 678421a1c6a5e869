#!/usr/bin/env bash
# foldpar train under pipeline parallelism, with real MPI processes and real files:
#  - the same 20 steps from the same seed give the same losses on one rank, pp=2,tsp=1
#    (m = 2), pp=2,tsp=2 (m = 4), pp=2,dp=2,tsp=1 and pp=2,dp=2,tsp=2 (m = 2 per replica)
#    and the baseline pp=2,tp=2 (m = 4);
#  - the same pipelined layout twice gives bitwise identical losses;
#  - a pp=2,tsp=2 checkpoint at step 10 resumed under tsp=4 and on one rank, and a one-rank
#    checkpoint resumed under pp=4: the next losses match the uninterrupted runs;
#  - verify passes (loss, logits, every gradient) under pp=2,tsp=1, pp=2,tsp=2, pp=4,tsp=1,
#    pp=2,tp=2:seqpar, pp=2,sp=2:ring, pp=4,tsp=1:zb and pp=2,tsp=2:zb;
#  - the interleaved schedule (pp=2, 2 chunks per rank) and ZB-H1 (pp=2,tsp=1) for 10 steps,
#    each checkpoint resumed under tsp=2, and ZB-H1 on pp=2,tp=2 and pp=2,tsp=2: the one-rank
#    losses;
#  - m < p, L < p, a --stage-layers list that does not sum to L, under interleaving m not
#    a multiple of p and p v > L, and ZB-H1 without a pp axis exit 2 with one line.
# The model is configs/tiny.json with 4 layers (so pp=4 has a layer per stage). Tolerance
# across layouts: 2e-5 relative, as train_layouts.sh (only the order of f32 sums differs).
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
/usr/bin/python3 - "$src/configs/tiny.json" "$tmp/model.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["num_hidden_layers"] = 4; json.dump(c, open(sys.argv[2], "w"))
PY
run() {  # run NP LAYOUT OUT [extra train flags]
  local np=$1 layout=$2 out=$3; shift 3
  "$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$bin" train --model "$tmp/model.json" \
    --data "$tmp/data" --out "$out" --layout "$layout" --steps 20 --seq 64 --batch 4 --lr 3e-3 --warmup 5 \
    --eval-every 0 --eval-batches 1 --print-every 100 --seed 7 "$@" >/dev/null
}
losses() { /usr/bin/python3 -c "import json,sys; [print(repr(json.loads(l)['loss'])) for l in open(sys.argv[1])]" "$1"; }
compare() {  # compare WANT GOT...: every run's 20 losses within 2e-5 of WANT's
  /usr/bin/python3 - "$tmp" "$@" <<'PY'
import json, sys
tmp, want, names = sys.argv[1], sys.argv[2], sys.argv[3:]
def losses(name):
    return [json.loads(l)["loss"] for l in open(f"{tmp}/{name}/metrics.jsonl")]
ref = losses(want)
assert len(ref) == 20, len(ref)
for name in names:
    got = losses(name)
    assert len(got) == 20, (name, len(got))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= 2e-5, f"{name}: losses differ from {want} by {worst:.2e} (relative)"
    print(f"{name}: worst relative difference from {want} {worst:.2e}")
PY
}
"$bin" prepare-data --out "$tmp/data" >/dev/null

run 1 tsp=1 "$tmp/one"
run 2 pp=2,tsp=1 "$tmp/pp2" --micro-batch 2
run 4 pp=2,tsp=2 "$tmp/pp2tsp2" --micro-batch 1
run 4 pp=2,dp=2,tsp=1 "$tmp/pp2dp2" --micro-batch 1
run 4 pp=2,tp=2 "$tmp/pp2tp2" --micro-batch 1
run 8 pp=2,dp=2,tsp=2 "$tmp/pp2dp2tsp2" --micro-batch 1
compare one pp2 pp2tsp2 pp2dp2 pp2tp2 pp2dp2tsp2
/usr/bin/python3 -c "
import json, sys
l = [json.loads(x)['loss'] for x in open('$tmp/one/metrics.jsonl')]
assert l[-1] < l[0] - 0.3, f'the loss should fall over 20 steps: {l[0]} -> {l[-1]}'"

# Bitwise determinism.
run 2 pp=2,tsp=1 "$tmp/pp2b" --micro-batch 2
cmp <(losses "$tmp/pp2/metrics.jsonl") <(losses "$tmp/pp2b/metrics.jsonl")

# Resharding across pp: pp=2,tsp=2 stops at step 10, tsp=4 and one rank continue; one rank
# stops at step 10 and pp=4 continues.
run 4 pp=2,tsp=2 "$tmp/from_pp" --micro-batch 1 --stop-after 10
cp -r "$tmp/from_pp" "$tmp/from_pp1"
run 4 tsp=4 "$tmp/from_pp" --micro-batch 1 --resume
run 1 tsp=1 "$tmp/from_pp1" --micro-batch 1 --resume
run 1 tsp=1 "$tmp/to_pp" --stop-after 10
run 4 pp=4,tsp=1 "$tmp/to_pp" --micro-batch 1 --resume
compare pp2tsp2 from_pp from_pp1
compare one to_pp

# The interleaved schedule (2 chunks per rank, m = 2): its first 10 steps, then its
# checkpoint resumed under tsp=2, give the one-rank losses.
run 2 pp=2,tsp=1 "$tmp/interleaved" --micro-batch 2 --schedule interleaved:2 --stop-after 10
run 2 tsp=2 "$tmp/interleaved" --micro-batch 2 --resume
compare one interleaved

# ZB-H1 (weight gradients deferred, m = 2): its first 10 steps, then its checkpoint resumed
# under tsp=2, give the one-rank losses; the same under pp=2,tp=2 and pp=2,tsp=2 (m = 4).
run 2 pp=2,tsp=1 "$tmp/zb" --micro-batch 2 --schedule zb --stop-after 10
run 2 tsp=2 "$tmp/zb" --micro-batch 2 --resume
run 4 pp=2,tp=2:zb "$tmp/zbtp" --micro-batch 1
run 4 pp=2,tsp=2 "$tmp/zbtsp" --micro-batch 1 --schedule zb
compare one zb zbtp zbtsp

# verify: loss, logits and every gradient of one pipelined step against the single-rank model.
for spec in "2 pp=2,tsp=1" "4 pp=2,tsp=2" "4 pp=4,tsp=1" "4 pp=2,tp=2:seqpar" "4 pp=2,sp=2:ring" "4 pp=4,tsp=1:zb" \
  "4 pp=2,tsp=2:zb"; do
  set -- $spec
  "$mpirun" --allow-run-as-root --oversubscribe -np "$1" "$bin" verify --model "$tmp/model.json" --layout "$2" \
    | grep ": PASS$" >/dev/null
done

# Refusals: one line, exit 2, naming the numbers.
failures=0
check() {  # check NP "needle" train-args...
  local np=$1 needle=$2; shift 2
  local err rc
  set +e
  err=$("$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$bin" train --model "$tmp/model.json" \
    --data "$tmp/data" --out "$tmp/refused" --steps 1 --seq 64 "$@" 2>&1 >/dev/null)
  rc=$?
  set -e
  if [ "$rc" -ne 2 ] || [ "$(grep -c '^foldpar: error' <<<"$err")" -ne 1 ] || ! grep -qF -- "$needle" <<<"$err"; then
    echo "FAIL: -np $np train $* -> exit $rc, wanted 2 and one line containing '$needle':" >&2
    echo "$err" >&2
    failures=$((failures + 1))
  fi
}
check 2 "1 micro-batches per step cannot fill 2 pipeline stages" --layout pp=2,tsp=1 --batch 2
check 4 "4 layers cannot fill 8 pipeline stages" --layout pp=8,tsp=1 --batch 8 --micro-batch 1
check 2 "--stage-layers 3,2 sums to 5, the model has 4 layers" --layout pp=2,tsp=1 --batch 4 --micro-batch 1 --stage-layers 3,2
check 2 "3 micro-batches per step must be a multiple of the 2 pipeline stages" --layout pp=2,tsp=1 --batch 3 \
  --micro-batch 1 --schedule interleaved:2
check 2 "4 layers cannot fill 2 pipeline stages x 3 chunks = 6 chunks" --layout pp=2,tsp=1 --batch 4 --schedule interleaved:3
check 2 "the zero-bubble schedule (zb) is the pp axis's" --layout tsp=2 --batch 4 --schedule zb
exit $((failures > 0))
