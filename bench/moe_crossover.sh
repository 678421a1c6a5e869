#!/usr/bin/env bash
# Where the MoE dispatch schemes cross over on this machine (issue 19's benchmark): for each S,
# the three schemes of a tsp=D layout (a2a, gather, ring; docs/composition.md section 3) are
# timed side by side in one bench-layouts run (interleaved repetitions, medians), beside the
# bytes each sends, the break-even of the byte formula (T = 2.25 E f_e / (k G) in training,
# T = B S / D tokens per rank) and the scheme `foldpar plan` picks for moe=auto. The table ends
# with the crossover S measured and the points where the plan's pick is not the fastest. X is
# the routing the plan assumed: the measured one's busiest-rank share, as plan --moe-imbalance.
# Usage: bench/moe_crossover.sh [config] [seqs] [steps] [ranks] [hardware]
#   defaults: configs/small-moe.json 1024,2048,4096,8192,16384 3 2 hardware/this-machine.json
# Run it on an otherwise idle machine: timing is honest at 2 ranks on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/small-moe.json}
seqs=${2:-1024,2048,4096,8192,16384}
steps=${3:-3}
ranks=${4:-2}
hardware=${5:-hardware/this-machine.json}
foldpar=build/tools/foldpar
[ -x "$foldpar" ] || { echo "moe_crossover: $foldpar is not built (./scripts/build.sh)" >&2; exit 2; }
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

mpirun -np "$ranks" "$foldpar" bench-layouts --model "$config" --seq "$seqs" --batch 1 --steps "$steps" \
  --hardware "$hardware" --layouts "tsp=$ranks:moe=a2a" "tsp=$ranks:moe=gather" "tsp=$ranks:moe=ring" \
  --out "$out/bench" >"$out/bench.log"
# The plan picks under the routing the step measured (bench-layouts' moe_imbalance: the X of
# plan --moe-imbalance that gives the busiest rank the measured busiest rank's rows); the
# three schemes route alike (same weights, same batch).
for s in ${seqs//,/ }; do
  x=$(/usr/bin/python3 -c 'import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r["seq"] == int(sys.argv[2])]
print(rows[0].get("moe_imbalance", 1.0))' "$out/bench/table.json" "$s")
  "$foldpar" plan --model "$config" --layouts "tsp=$ranks" --devices "$ranks" --seq "$s" --batch 1 \
    --hardware "$hardware" --moe-imbalance "$x" >"$out/plan.$s"
done

/usr/bin/python3 - "$out" "$seqs" "$ranks" "$config" <<'PY'
import json, re, sys
out, seqs, D, config = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4]
rows = json.load(open(f"{out}/bench/table.json"))
cfg = json.load(open(config))
E = cfg.get("num_local_experts") or cfg.get("num_experts")
k = cfg["num_experts_per_tok"]
f_e = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
G = max(1, D // E)
t_star = 2.25 * E * f_e / (k * G)
schemes = ["a2a", "gather", "ring"]
print(f"{config}: E={E} k={k} f_e={f_e} on tsp={D} (G={G}); training break-even of the bytes "
      f"T* = 2.25 E f_e / (k G) = {t_star:.0f} tokens per rank")
print(f"{'S':>6} {'T':>6} {'X':>5} " + " ".join(f"{s + ' s':>9}" for s in schemes) + " " +
      " ".join(f"{s + ' MB':>10}" for s in schemes) + f" {'fastest':>8} {'by bytes':>9} {'plan':>6} {'plan ok':>8}")
misses, fastest_by_s = [], {}
for s in seqs:
    t = {r["layout"].split("moe=")[1]: r for r in rows if r["seq"] == s}
    step = {x: t[x]["step_s"] for x in schemes}
    fastest = min(schemes, key=lambda x: step[x])
    by_bytes = min(schemes, key=lambda x: t[x]["bytes_sent"])
    m = re.search(r"auto: (\w+)", open(f"{out}/plan.{s}").read())
    plan = m.group(1) if m else "?"
    # Within 3% of the fastest counts as a tie: closer than this machine's run-to-run spread.
    ok = step[plan] <= 1.03 * step[fastest] if plan in step else False
    if not ok: misses.append(s)
    fastest_by_s[s] = fastest
    T = s // D
    x = t["a2a"].get("moe_imbalance", 1.0)
    print(f"{s:>6} {T:>6} {x:>5.2f} " + " ".join(f"{step[x]:>9.3f}" for x in schemes) + " " +
          " ".join(f"{t[x]['bytes_sent'] / 1e6:>10.2f}" for x in schemes) +
          f" {fastest:>8} {by_bytes:>9} {plan:>6} {'yes' if ok else 'NO':>8}")
cross = [s for a, s in zip(seqs, seqs[1:]) if (fastest_by_s[a] == "ring") != (fastest_by_s[s] == "ring")]
print("measured crossover to the ring:", ", ".join(f"between S={seqs[seqs.index(s) - 1]} and S={s}" for s in cross)
      if cross else "none in this range")
print("plan's pick slower than the fastest by over 3%:", ", ".join(f"S={s}" for s in misses) if misses else "nowhere")
PY
