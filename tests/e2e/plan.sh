#!/usr/bin/env bash
# foldpar plan and foldpar bench --layouts, end to end: the plan's table and JSON for the
# paper's model on the paper's node (in bf16 every strategy planned, the fastest fitting one
# recommended, TSP over TP; in f32 TP over by a stated amount),
# exit 2 with one line naming the values on bad input, and a 2-rank layout bench at tiny
# scale writing its CSV, JSON and PNGs with predictions beside measurements.
set -u
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# ---- the plan: table and JSON ----
# In bf16 every strategy is buildable (tsp and the Megatron layouts store bf16 alike); the
# recommendation is the fastest layout that fits, whichever strategy it is.
# One layout of each strategy and mesh (every candidate is buildable in bf16:
# tests/unit/plan_test.cc); each costs a dry run of the 7B model at 128K.
"$bin" plan --model "$src/configs/paper-7b.json" --seq 131072 --devices 8 --hardware "$src/hardware/mi300x-8.json" \
  --bf16 --layouts tsp=8 tp=8 sp=8 tp=2,sp=4 --json >"$tmp/plan.json" || fail "plan --json exited $?"
/usr/bin/python3 - "$tmp/plan.json" <<'PY' || fail "plan --json content"
import json, sys
j = json.load(open(sys.argv[1]))
names = {l["layout"]: l for l in j["layouts"]}
assert j["not_buildable"] == [], j["not_buildable"]
assert sorted(names) == sorted(["tsp=8:bf16", "tp=8:bf16", "sp=8:bf16", "tp=2,sp=4:bf16"]), list(names)
assert all(n.endswith(":bf16") for n in names), list(names)
fitting = [l for l in j["layouts"] if l["fits"]]
best = max(fitting, key=lambda l: l["time"]["tokens_per_s"])
assert j["recommended"] == best["layout"], (j["recommended"], best["layout"])
assert names["tsp=8:bf16"]["fits"] and not names["tp=8:bf16"]["fits"]
t = names["tsp=8:bf16"]
m = t["memory_bytes"]
assert m["total"] == m["peak"] + m["optimizer_state"]
assert m["peak"] == sum(m[k] for k in ["parameters", "gradients", "optimizer", "activations", "comm", "workspace", "kv_cache"])
assert t["traffic"]["tsp"]["broadcast"]["bytes_sent"] > 0 and t["traffic"]["tsp"]["link"] == "intra_node"
assert names["tsp=8:bf16"]["time"]["tokens_per_s"] > 0
# tp=8 and tsp=8 each hold an eighth of the weights, both in bf16.
assert names["tp=8:bf16"]["memory_bytes"]["parameters"] == t["memory_bytes"]["parameters"]
PY
# The table's wording of those verdicts. Only tp=8's row is planned again (tsp=8's dry run at
# 128K is most of this test's time, and the JSON above holds its verdict and the
# recommendation); the recommendation's marker is read from a tiny plan below.
out=$("$bin" plan --model "$src/configs/paper-7b.json" --seq 131072 --devices 8 --hardware "$src/hardware/mi300x-8.json" \
  --bf16 --layouts tp=8)
rc=$?
[ "$rc" -eq 0 ] || fail "plan exited $rc"
grep -q '^tp=8:bf16 .*no, over by [0-9.]* GB' <<<"$out" || fail "tp=8:bf16 is not planned in bf16:"$'\n'"$out"
# Generation modes and dp.
"$bin" plan --model "$src/configs/paper-7b.json" --seq 32768 --devices 8 --hardware "$src/hardware/h200-8.json" \
  --decode --max-new-tokens 1024 --batch 8 | grep -q '^tsp=8 ' || fail "plan --decode lists no tsp=8"
"$bin" plan --model "$src/configs/paper-7b.json" --seq 16384 --devices 16 --batch 2 --hardware "$src/hardware/mi300x-8.json" \
  --bf16 | grep -q "^dp=2,tsp=8:bf16 " || fail "plan over 2 nodes lists no dp=2,tsp=8"

# ---- bad input: exit 2, one line naming the values ----
check() {  # check "needle" args...
  local needle=$1; shift
  local err rc
  err=$("$bin" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -ne 2 ] || [ "$(grep -c '^foldpar: error' <<<"$err")" -ne 1 ] || ! grep -qF -- "$needle" <<<"$err"; then
    fail "foldpar $* -> exit $rc, wanted 2 and one line containing '$needle':"$'\n'"$err"
  fi
}
hw="$src/hardware/mi300x-8.json"
# The old '+' spelling and the old comma-separated list still work, with a note naming the
# canonical form; "tp=2,sp=2" is one 2-D layout.
old=$("$bin" plan --model "$src/configs/tiny.json" --seq 128 --devices 4 --hardware "$hw" --layouts "tsp=4,tp=2+sp=2" 2>&1)
grep -qF "note: the layout list 'tsp=4,tp=2+sp=2' is written 'tsp=4 tp=2,sp=2'" <<<"$old" || fail "old list: $old"
grep -q "^tp=2,sp=2 " <<<"$old" || fail "old list gave no tp=2,sp=2 row: $old"
new=$("$bin" plan --model "$src/configs/tiny.json" --seq 128 --devices 4 --hardware "$hw" --layouts tp=2,sp=2 tsp=4 2>&1)
{ grep -q "^tp=2,sp=2 " <<<"$new" && grep -q "^tsp=4 " <<<"$new" && ! grep -q "note:" <<<"$new"; } || fail "new list: $new"
[ "$(grep -c '<- recommended' <<<"$new")" = 1 ] || fail "not exactly one row of the tiny plan is recommended: $new"
# The plan chooses a pipeline's schedule (--choose-schedule; always for its own candidates):
# each schedule tried is in the JSON, and a text line names the choice and why.
"$bin" plan --model "$src/configs/tiny.json" --seq 256 --batch 4 --devices 2 --hardware "$hw" \
  --layouts pp=2,tp=1 --choose-schedule --json >"$tmp/sched.json" 2>&1
/usr/bin/python3 - "$tmp/sched.json" <<'PY' || fail "plan --choose-schedule --json: $(cat "$tmp/sched.json")"
import json, sys
p = json.load(open(sys.argv[1]))["layouts"][0]["pipeline"]
names = [t["schedule"] for t in p["schedule_tried"]]
assert names[0] == "1f1b" and "zb" in names, names
assert p["schedule"] in names and p["schedule_reason"].startswith(p["schedule"] + " at m="), p
PY
sched=$("$bin" plan --model "$src/configs/tiny.json" --seq 256 --batch 4 --devices 2 --hardware "$hw" \
  --layouts pp=2,tp=1 --choose-schedule 2>&1)
grep -q "^schedule pp=2,tp=1.*: .* at m=.*tokens/s, bubble" <<<"$sched" || fail "plan --choose-schedule text: $sched"
# The seqpar case the old plan recommended and the strategy refused (S=20, tp=4 x sp=2).
seqpar=$("$bin" plan --model "$src/configs/tiny.json" --seq 20 --devices 8 --hardware "$hw" 2>&1)
grep -q "^tp=4,sp=2:seqpar " <<<"$seqpar" && fail "plan lists tp=4,sp=2:seqpar at S=20: $seqpar"
grep -qF "not buildable: tp=4,sp=2:seqpar: the sequence length (20) must be divisible by the sp degree x the tp degree (2 x 4 = 8)" <<<"$seqpar" || fail "S=20 seqpar: $seqpar"

check "--devices (0)" plan --model "$src/configs/tiny.json" --seq 128 --devices 0 --hardware "$hw"
check "unknown axis 'xp'" plan --model "$src/configs/tiny.json" --seq 128 --devices 2 --hardware "$hw" --layouts xp=2
check "num_attention_heads (8) must be divisible by the TSP degree (3)" \
  plan --model "$src/configs/tiny.json" --seq 96 --devices 3 --hardware "$hw" --layouts tsp=3
check "uses 4 ranks, not 2" plan --model "$src/configs/tiny.json" --seq 128 --devices 2 --hardware "$hw" --layouts tsp=4
check "nope.json" plan --model "$src/configs/tiny.json" --seq 128 --devices 2 --hardware "$tmp/nope.json"
echo '{"devices_per_node": 8}' >"$tmp/bad.json"
check "memory_per_device_gb" plan --model "$src/configs/tiny.json" --seq 128 --devices 2 --hardware "$tmp/bad.json"
check "one of --train" plan --model "$src/configs/tiny.json" --seq 128 --devices 2 --hardware "$hw" --train --decode
check "bench: --model is required" bench --seq 128

# ---- bench-layouts at tiny scale, 2 ranks ----
# tp=2:bf16: the Megatron strategy's bf16 bytes, measured, equal the plan's.
bench=$("$mpirun" --allow-run-as-root -np 2 "$bin" bench-layouts --layouts tsp=2 tp=2 sp=2:ring tp=2:bf16 --model "$src/configs/tiny.json" \
  --seq 128,256 --steps 1 --hardware "$src/hardware/this-machine.json" --out "$tmp/bench" 2>&1)
rc=$?
[ "$rc" -eq 0 ] || fail "bench --layouts exited $rc:"$'\n'"$bench"
for f in table.csv table.json memory.png throughput.png predicted.png; do
  [ -s "$tmp/bench/$f" ] || fail "bench --layouts wrote no $f"
done
/usr/bin/python3 - "$tmp/bench/table.json" <<'PY' || fail "bench table.json content"
import json, sys
rows = json.load(open(sys.argv[1]))
assert len(rows) == 8, len(rows)
assert {r["layout"] for r in rows} == {"tsp=2", "tp=2", "sp=2:ring", "tp=2:bf16"}, rows
for r in rows:
    assert r["bytes_sent"] == r["predicted_bytes_sent"], r
    assert abs(r["predicted_peak_bytes"] / r["peak_bytes"] - 1) <= 0.10, r
    assert r["step_s"] > 0 and r["predicted_step_s"] > 0, r
    assert r["step_samples_s"] == [r["step_s"]], r  # one repetition: the median is it
PY
[ "$(head -1 "$tmp/bench/table.csv" | cut -d, -f1-3)" = "layout,seq,batch" ] || fail "table.csv header"
# The ranking per S: the measured and planned orders, and with one repetition no pair decided.
for s in 128 256; do
  grep -q "^ranking S=$s: measured .* < .*; planned .* < " <<<"$bench" || fail "bench-layouts states no ranking at S=$s: $bench"
  grep -q "^ranking S=$s: too few repetitions (1) to decide a pair (a sign test needs at least 5)$" <<<"$bench" ||
    fail "bench-layouts decides a ranking from one repetition at S=$s: $bench"
done
# A MoE model: each row carries the timed step's expert load (B S k tokens per sparse layer,
# the same for every scheme: same weights, same batch) and the routing the prediction assumed
# from it, the plan's --moe-imbalance X that gives the busiest rank the measured busiest
# rank's rows (recomputed here from the load).
bench=$("$mpirun" --allow-run-as-root -np 2 "$bin" bench-layouts --layouts tsp=2:moe=a2a tsp=2:moe=ring \
  --model "$src/configs/tiny-moe.json" --seq 128 --batch 2 --steps 1 --hardware "$src/hardware/this-machine.json" \
  --out "$tmp/bench-moe" 2>&1) || fail "bench-layouts on a MoE model: $bench"
grep -q '^moe routing tsp=2:moe=a2a S=128: tokens per expert [0-9 ]*; predicted with --moe-imbalance [0-9.]*$' \
  <<<"$bench" || fail "bench-layouts does not state the MoE routing: $bench"
/usr/bin/python3 - "$tmp/bench-moe/table.json" <<'PY' || fail "bench-layouts MoE table.json content"
import json, sys
rows = json.load(open(sys.argv[1]))
assert len(rows) == 2, rows
E, k, layers, D = 4, 2, 2, 2
m = E // D
for r in rows:
    load = r["expert_load"]
    assert len(load) == E and sum(load) == 2 * 128 * k * layers, load
    R = max(sum(load[i:i + m]) for i in range(0, E, m)) / (sum(load) / D)
    x = min(max((R * m * (E - 1) - (m - 1) * E) / (E - m), 1.0), E / k)
    assert abs(r["moe_imbalance"] - x) < 1e-9, (r["moe_imbalance"], x, load)
    assert r["step_s"] > 0 and r["predicted_step_s"] > 0, r
assert rows[0]["expert_load"] == rows[1]["expert_load"], rows
PY
# A pipeline runs its batch as micro-batches (one sequence each by default: m = B = 4) through
# its schedule; its worst rank's peak and bytes (the boundary's included) equal the plan's.
bench=$("$mpirun" --allow-run-as-root -np 2 "$bin" bench-layouts --layouts pp=2,tsp=1 pp=2,tsp=1:zb \
  --model "$src/configs/tiny.json" --seq 128 --batch 4 --steps 1 --out "$tmp/bench-pp" 2>&1) ||
  fail "bench-layouts with pp: $bench"
/usr/bin/python3 - "$tmp/bench-pp/table.json" <<'PY' || fail "bench-layouts pp table.json content"
import json, sys
rows = json.load(open(sys.argv[1]))
assert [r["layout"] for r in rows] == ["pp=2,tsp=1", "pp=2,tsp=1:zb"], rows
for r in rows:
    assert r["bytes_sent"] == r["predicted_bytes_sent"] > 0, r
    assert r["peak_bytes"] == r["predicted_peak_bytes"], r
PY
err=$("$mpirun" --allow-run-as-root -np 2 "$bin" bench-layouts --layouts pp=2,tsp=1 --model "$src/configs/tiny.json" \
  --seq 128 --batch 4 --micro-batch 4 --steps 1 2>&1)
grep -q "1 micro-batches per step cannot fill 2 pipeline stages" <<<"$err" || fail "bench-layouts m < p: $err"
# --profile: rank 0's backend ops of the timed step beside the plan's, the same calls; then
# its time blocked in each axis's operations beside the simulated stalls, the same calls.
prof=$("$mpirun" --allow-run-as-root -np 2 "$bin" bench-layouts --layouts tsp=2 sp=2 --model "$src/configs/tiny.json" \
  --seq 128 --steps 1 --profile --hardware "$src/hardware/this-machine.json" 2>&1) || fail "bench-layouts --profile: $prof"
/usr/bin/python3 - "$prof" <<'PY' || fail "bench-layouts --profile content: $prof"
import re, sys
text = sys.argv[1]
blocks = re.split(r"\n(?=S 128 )", text)
heads = [b.split("\n", 1)[0] for b in blocks if b.startswith("S 128 ")]
assert [h.split(":")[0] for h in heads] == ["S 128 tsp=2", "S 128 sp=2"], heads
for b in blocks[1:]:
    ops_part, _, blocked_part = b.partition("  blocked in (axis op)")
    rows = {l.split()[0]: l.split() for l in ops_part.splitlines()[2:] if l.strip()}
    # Rank 0's time blocked per (axis, op), beside the timeline's transfers: the same calls.
    waits = [l.split() for l in blocked_part.splitlines()[1:] if l.strip()]
    axis = heads[blocks.index(b) - 1].split()[2].split("=")[0]
    assert {w[0] for w in waits} == {axis}, (axis, waits)
    assert {"all_gather", "reduce_scatter"} <= {w[1] for w in waits}, waits
    for w in waits:
        assert int(w[5]) == int(w[6]) > 0 and float(w[2]) >= 0, w
    for op in ("matmul", "attention_forward", "attention_backward", "rmsnorm_forward"):
        assert op in rows, (op, b)
        measured, planned = int(rows[op][4]), int(rows[op][5])
        assert measured == planned > 0, (op, rows[op])
    for op in ("matmul", "attention_forward", "attention_backward"):
        assert float(rows[op][1]) > 0 and float(rows[op][2]) > 0, rows[op]
PY
err=$("$mpirun" --allow-run-as-root -np 2 "$bin" bench --layouts tsp=4 --model "$src/configs/tiny.json" --seq 128 2>&1 >/dev/null)
rc=$?
{ [ "$rc" -eq 2 ] && grep -qF "uses 4 ranks, the job has 2" <<<"$err"; } || fail "bench --layouts tsp=4 on 2 ranks -> $rc: $err"
# The old spelling still runs bench-layouts, after one line naming the new command.
[ "$(grep -c '^foldpar: note: `bench --layouts` is now `foldpar bench-layouts`' <<<"$err")" = 1 ] ||
  fail "bench --layouts does not name bench-layouts once: $err"
# ---- the dry run behind the plan: --explain, --trace, and the paper's scale ----
out=$("$bin" plan --model "$src/configs/tiny.json" --seq 64 --devices 2 --hardware "$src/hardware/this-machine.json" \
  --layouts tsp=2 --explain --trace "$tmp/trace.json" 2>&1) || fail "plan --explain --trace: $out"
grep -q "^explain tsp=2:" <<<"$out" || fail "plan --explain names no layout: $out"
grep -qE "compute-bound|bound by " <<<"$out" || fail "plan --explain names no bound: $out"
/usr/bin/python3 - "$tmp/trace.json" <<'PY' || fail "plan --trace content"
import json, sys
ev = json.load(open(sys.argv[1]))["traceEvents"]
x = [e for e in ev if e.get("ph") == "X"]
assert {e["pid"] for e in x} == {0, 1}, "both distinct ranks of tsp=2 are traced"
assert any(e["tid"] == 0 and e["name"] == "matmul" for e in x), "compute stream has the GEMMs"
assert any(e["tid"] != 0 and e["name"] in ("broadcast tsp", "all_gather tsp", "send_recv tsp") for e in x), "TSP transfers"
assert all(e["dur"] >= 0 for e in x)
PY
# The 7B model at S = 128K on 8 MI300X (docs/PERFORMANCE.md times it): the real strategies'
# peaks, with tsp=8 fitting in 192 GB and tp=8 not.
out=$("$bin" plan --model "$src/configs/paper-7b.json" --seq 131072 --devices 8 --hardware "$src/hardware/mi300x-8.json" \
  --layouts tsp=8 tp=8 --json 2>&1) || fail "plan of the 7B model at 128K: $out"
printf '%s' "$out" >"$tmp/7b.json"
/usr/bin/python3 - "$tmp/7b.json" <<'PY' || fail "plan of the 7B model at 128K: verdicts"
import json, sys
p = json.load(open(sys.argv[1]))
fits = {l["layout"]: l["fits"] for l in p["layouts"]}
assert fits == {"tsp=8": True, "tp=8": False}, fits
assert [l["over_bytes"] > 0 for l in p["layouts"]] == [False, True]
PY
# The table's wording of that verdict (only tp=8's row is read: tsp=8's simulation at 128K is
# most of the run, and the JSON above already holds its verdict).
out=$("$bin" plan --model "$src/configs/paper-7b.json" --seq 131072 --devices 8 --hardware "$src/hardware/mi300x-8.json" \
  --layouts tp=8 2>&1) || fail "plan of the 7B model at 128K (text): $out"
grep -q '^tp=8 .*no, over by [0-9.]* GB' <<<"$out" || fail "tp=8 does not say by how much it is over:"$'\n'"$out"
# ---- the search's experts over dp replicas (ep = K G) on a MoE model ----
# 4 devices, batch 4: the search proposes ep=4 over dp=2 on TSP and Megatron, rows named in
# the table (the JSON's rows: tests/unit/plan_test.cc).
out=$("$bin" plan --model "$src/configs/tiny-moe.json" --seq 128 --batch 4 --devices 4 --hardware "$hw" 2>&1) ||
  fail "plan search of a MoE model: $out"
grep -q '^dp=2,tsp=2,ep=4[: ]' <<<"$out" || fail "the MoE search has no dp=2,tsp=2,ep=4 row:"$'\n'"$out"
grep -q '^dp=2,tp=2,ep=4 ' <<<"$out" || fail "the MoE search has no dp=2,tp=2,ep=4 row:"$'\n'"$out"
grep -q "ep=" <<<"$("$bin" plan --model "$src/configs/tiny.json" --seq 128 --batch 4 --devices 4 --hardware "$hw" 2>&1)" &&
  fail "the dense model's search proposes ep"
# Memory spreads the experts: a vocabulary and a sequence no 2-rank model axis divides leave
# dp=2,tsp=1 and dp=2,tsp=1,ep=2; with memory between their totals the search picks the ep
# row, and --explain explains it.
/usr/bin/python3 - "$src/configs/tiny-moe.json" "$tmp/wide-moe.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(vocab_size=255, intermediate_size=4096)  # Mixtral: f_e = f, the experts dominate
json.dump(c, open(sys.argv[2], "w"))
PY
"$bin" plan --model "$tmp/wide-moe.json" --seq 66 --batch 2 --devices 2 --hardware "$hw" --json >"$tmp/wide.json" 2>"$tmp/wide.err" ||
  fail "plan search of the wide-expert model: $(cat "$tmp/wide.err")"
/usr/bin/python3 - "$tmp/wide.json" "$hw" "$tmp/hw-mid.json" <<'PY' || fail "the wide-expert search: $(cat "$tmp/wide.json")"
import json, sys
p = json.load(open(sys.argv[1]))
total = {l["layout"]: l["memory_bytes"]["total"] for l in p["layouts"]}
assert len(total) == 2 and {k.split(":")[0] for k in total} == {"dp=2,tsp=1", "dp=2,tsp=1,ep=2"}, total
whole = next(v for k, v in total.items() if k.split(":")[0] == "dp=2,tsp=1")
spread = next(v for k, v in total.items() if k.split(":")[0] == "dp=2,tsp=1,ep=2")
assert spread < whole, total
hw = json.load(open(sys.argv[2]))
hw["memory_per_device_gb"] = (spread + whole) / 2 / 1e9
json.dump(hw, open(sys.argv[3], "w"))
PY
out=$("$bin" plan --model "$tmp/wide-moe.json" --seq 66 --batch 2 --devices 2 --hardware "$tmp/hw-mid.json" --explain 2>&1) ||
  fail "plan --explain of the wide-expert model: $out"
grep -q '^recommended: dp=2,tsp=1,ep=2' <<<"$out" || fail "memory did not make the search pick ep=2:"$'\n'"$out"
grep -q '^explain dp=2,tsp=1,ep=2' <<<"$out" || fail "plan --explain does not explain the ep pick:"$'\n'"$out"
exit $((failures > 0))
