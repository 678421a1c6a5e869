#!/usr/bin/env bash
# foldpar generate with real MPI processes and real files, from a tiny model trained here:
#  - greedy generations are identical on one rank, tsp=2, tsp=4, tp=2, tp=4, with the
#    contiguous split, and under pp=2,tsp=1, pp=2,tsp=2 (batches of 2 and 1 prompts) and pp=2,tp=2
#    (groups in flight across steps, and --lockstep); sampled ones (temperature, top-k, top-p, seed) too, and they follow
#    the seed;
#  - the exported Hugging Face directory generates the same text as the checkpoint;
#  - a stop sequence ends the completion before it; one prompt streams its text;
#  - mistakes exit 2 with one line naming the problem.
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" prepare-data --out "$tmp/data" >/dev/null
"$bin" train --model "$src/configs/tiny.json" --data "$tmp/data" --out "$tmp/run" --steps 120 --seq 64 --batch 8 \
  --lr 3e-3 --warmup 5 --eval-every 0 --progress none >/dev/null
printf 'The \nQ: What is\n' >"$tmp/prompts.txt"

gen() {  # gen NP OUT [flags]: JSON lines of the completions
  local np=$1 out=$2; shift 2
  "$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$bin" generate --checkpoint "$tmp/run" \
    --prompt-file "$tmp/prompts.txt" --prompt "A fool and" --max-new-tokens 24 --json "$@" >"$out" 2>"$out.err"
}
gen 1 "$tmp/one.jsonl"
grep -q "decode .* tokens/s" "$tmp/one.jsonl.err"
gen 2 "$tmp/tsp2.jsonl" --layout tsp=2
gen 4 "$tmp/tsp4.jsonl" --layout tsp=4
gen 2 "$tmp/tp2.jsonl" --layout tp=2
gen 4 "$tmp/tp4.jsonl" --layout tp=4
gen 2 "$tmp/contig.jsonl" --layout tsp=2 --seq-split contiguous --batch 2
gen 2 "$tmp/pp2.jsonl" --layout pp=2,tsp=1
gen 4 "$tmp/pp2tsp2.jsonl" --layout pp=2,tsp=2 --batch 2
gen 4 "$tmp/pp2tp2.jsonl" --layout pp=2,tp=2
gen 2 "$tmp/pp2lock.jsonl" --layout pp=2,tsp=1 --lockstep
for f in tsp2 tsp4 tp2 tp4 contig pp2 pp2tsp2 pp2tp2 pp2lock; do
  cmp "$tmp/one.jsonl" "$tmp/$f.jsonl" || { echo "greedy generations differ: one rank vs $f" >&2; exit 1; }
done
/usr/bin/python3 - "$tmp/one.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert sorted(r["index"] for r in rows) == [0, 1, 2], rows
assert all(r["tokens"] == 24 and r["stop_reason"] == "length" and len(r["completion"]) == 24 for r in rows), rows
PY

sample=(--temperature 0.9 --top-k 20 --top-p 0.95)
gen 1 "$tmp/s1.jsonl" "${sample[@]}" --seed 5
gen 2 "$tmp/s2.jsonl" "${sample[@]}" --seed 5 --layout tsp=2
gen 2 "$tmp/s3.jsonl" "${sample[@]}" --seed 5 --layout tp=2
gen 1 "$tmp/s4.jsonl" "${sample[@]}" --seed 6
gen 2 "$tmp/s5.jsonl" "${sample[@]}" --seed 5 --layout pp=2,tsp=1
cmp "$tmp/s1.jsonl" "$tmp/s2.jsonl"
cmp "$tmp/s1.jsonl" "$tmp/s3.jsonl"
cmp "$tmp/s1.jsonl" "$tmp/s5.jsonl"
! cmp -s "$tmp/s1.jsonl" "$tmp/one.jsonl" || { echo "sampling gave the greedy text" >&2; exit 1; }
! cmp -s "$tmp/s1.jsonl" "$tmp/s4.jsonl" || { echo "another seed gave the same samples" >&2; exit 1; }

# The exported Hugging Face directory, on two ranks (tsp=2, and pp=2: each stage loads its layers).
"$bin" export --checkpoint "$(ls -d "$tmp"/run/checkpoints/step-* | tail -1)" -o "$tmp/hf" >/dev/null
"$mpirun" --allow-run-as-root -np 2 "$bin" generate --hf "$tmp/hf" --prompt-file "$tmp/prompts.txt" \
  --prompt "A fool and" --max-new-tokens 24 --json >"$tmp/hf.jsonl" 2>/dev/null
cmp "$tmp/one.jsonl" "$tmp/hf.jsonl"
"$mpirun" --allow-run-as-root -np 2 "$bin" generate --hf "$tmp/hf" --prompt-file "$tmp/prompts.txt" \
  --prompt "A fool and" --max-new-tokens 24 --json --layout pp=2,tsp=1 >"$tmp/hf_pp.jsonl" 2>/dev/null
cmp "$tmp/one.jsonl" "$tmp/hf_pp.jsonl"

# A stop sequence taken from the middle of the first greedy completion ends it there.
stop=$(/usr/bin/python3 -c "import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if r['index'] == 0][0]['completion'][5:8])" "$tmp/one.jsonl")
gen 2 "$tmp/stop.jsonl" --layout tsp=2 --stop "$stop"
/usr/bin/python3 - "$tmp/one.jsonl" "$tmp/stop.jsonl" "$stop" <<'PY'
import json, sys
full = [r for r in map(json.loads, open(sys.argv[1])) if r["index"] == 0][0]["completion"]
got = [r for r in map(json.loads, open(sys.argv[2])) if r["index"] == 0][0]  # printed as they finish
stop = sys.argv[3]
assert got["stop_reason"] == "stop", got
assert got["completion"] == full[: full.index(stop)], (got, full, stop)
PY
# The same with the sampler inside the pipeline (pp=2, three prompts in flight).
gen 2 "$tmp/stop_pp.jsonl" --layout pp=2,tsp=1 --stop "$stop"
cmp "$tmp/stop.jsonl" "$tmp/stop_pp.jsonl"

# One prompt streams plain text: the same completion, then a newline.
"$mpirun" --allow-run-as-root -np 2 "$bin" generate --checkpoint "$tmp/run" --prompt "A fool and" \
  --max-new-tokens 24 >"$tmp/stream.txt" 2>/dev/null
/usr/bin/python3 - "$tmp/one.jsonl" "$tmp/stream.txt" <<'PY'
import json, sys
want = [r for r in map(json.loads, open(sys.argv[1])) if r["index"] == 2][0]["completion"] + "\n"
got = open(sys.argv[2], encoding="latin-1", newline="").read()
assert got == want, (got, want)
PY

# Mistakes: exit 2, one line.
failures=0
# NP 1 runs the program alone (an MPI singleton): mpirun costs about 2 s a start here, and
# the NP 2 cases check the exit code through mpirun.
check() {  # check NP "needle" args...
  local np=$1 needle=$2; shift 2
  local err rc=0
  if [ "$np" = 1 ]; then
    err=$("$bin" generate "$@" 2>&1 >/dev/null) || rc=$?
  else
    err=$("$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$bin" generate "$@" 2>&1 >/dev/null) || rc=$?
  fi
  if [ "$rc" -ne 2 ] || [ "$(grep -c '^foldpar: error' <<<"$err")" -ne 1 ] || ! grep -qF -- "$needle" <<<"$err"; then
    echo "FAIL: -np $np foldpar generate $* -> exit $rc, wanted 2 and one line containing '$needle':" >&2
    echo "$err" >&2
    failures=$((failures + 1))
  fi
}
check 1 "no prompt" --checkpoint "$tmp/run"
check 1 "exactly one of --checkpoint and --hf" --checkpoint "$tmp/run" --hf "$tmp/hf" --prompt x
check 1 "does not exist" --checkpoint "$tmp/none" --prompt x
check 2 "generation runs on tsp=N or tp=N" --checkpoint "$tmp/run" --prompt x --layout sp=2
check 2 "needs 4 ranks" --checkpoint "$tmp/run" --prompt x --layout tsp=4
check 2 "bf16 is not implemented" --checkpoint "$tmp/run" --prompt x --layout pp=2,tp=1:bf16
check 1 "--temperature (-1)" --checkpoint "$tmp/run" --prompt x --temperature -1
check 1 "--top-p (2)" --checkpoint "$tmp/run" --prompt x --top-p 2
check 1 "--max-new-tokens (0)" --checkpoint "$tmp/run" --prompt x --max-new-tokens 0
check 1 "exceeds max_position_embeddings (4096)" --checkpoint "$tmp/run" --prompt x --max-new-tokens 5000
check 1 "prompt file" --checkpoint "$tmp/run" --prompt-file "$tmp/missing.txt"
exit $((failures > 0))
