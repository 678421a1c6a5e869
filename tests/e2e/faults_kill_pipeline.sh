#!/usr/bin/env bash
# A rank of a pipelined training job (pp=2,tsp=2, 4 ranks, m = 4 micro-batches) is killed
# (SIGKILL) in the middle of a step: world rank 3, stage 1's TSP index 1, the last stage's
# half of the loss. Asserts:
#  1. plain mpirun: it exits non-zero within the watchdog timeout plus a margin, naming rank 3
#     and the host; no process of the job is left; rank 0 never finished training;
#  2. the newest complete checkpoint resumes under pp=2,tsp=2 with the losses of an
#     undisturbed run bit for bit, and (checkpoints are layout-independent) under tsp=2 on
#     half the ranks within 2e-5 (only the order of f32 sums differs, as train_pipeline.sh);
#  3. mpirun --enable-recovery (the launcher lets the job run on after the death): the
#     survivors' watchdog ends it, naming world rank 3 as dead ("no answer").
set -euo pipefail
mpirun=$1 bin=$2 src=$3
here=$(cd "$(dirname "$0")" && pwd)
source "$here/faults_lib.sh"
tmp=$(mktemp -d)
trap 'for p in $(pgrep -f -- "$tmp/"); do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT
host=$(hostname)
"$bin" prepare-data --out "$tmp/data" >/dev/null
# A step takes 10-40 ms here, so the killed job's horizon is 200 steps: it cannot finish in
# the moment between step 4's line and the kill. The resumed and the reference runs stop 3
# steps after the checkpoint resumed from (--stop-after), whichever step that is.
args=(train --model "$src/configs/tiny.json" --data "$tmp/data" --steps 200 --seq 128 --batch 4
      --micro-batch 1 --eval-every 0 --eval-batches 1 --progress none --seed 3 --checkpoint-every 3)
pp_train() { "$mpirun" --allow-run-as-root --oversubscribe -np 4 "$@"; }

# kill_rank3 OUT TIMEOUT [mpirun flags]: starts the job, kills world rank 3 once step 4 is
# done, waits for mpirun; sets killed_in, job_s (seconds from the kill to mpirun's exit), job_rc.
kill_rank3() {
  local out=$1 timeout=$2
  shift 2
  FOLDPAR_COMM_TIMEOUT=$timeout pp_train "$@" "$bin" "${args[@]}" --layout pp=2,tsp=2 --out "$out" \
    >"$out.log" 2>&1 &
  kill_rank_of_job $! "$out" "$timeout" 3 4
}

# 1. mpirun ends the job.
kill_rank3 "$tmp/killed" 30
[ "$job_rc" -ne 0 ] || die "mpirun exited 0 after rank 3 was killed"
grep -Eq "mpi(run|exec) noticed that process rank 3 with PID [0-9]* on node $host exited on signal 9" "$tmp/killed.log" ||
  { cat "$tmp/killed.log" >&2; die "mpirun's message does not name rank 3 on $host"; }
echo "killed rank 3 in step $killed_in: the job ended in $job_s s, exit $job_rc"

# 2. Resume: the same layout bit for bit, and tsp=2 on two ranks within 2e-5.
from=$(newest_checkpoint "$tmp/killed/checkpoints")
[ "$from" -ge 3 ] || die "no checkpoint before the kill"
last=$((from + 3))
cp -r "$tmp/killed" "$tmp/killed_tsp"
pp_train "$bin" "${args[@]}" --layout pp=2,tsp=2 --out "$tmp/killed" --resume --stop-after $last >/dev/null
pp_train "$bin" "${args[@]}" --layout pp=2,tsp=2 --out "$tmp/clean" --stop-after $last >/dev/null
same_losses "$tmp/killed" "$tmp/clean" $((from + 1)) $last
"$mpirun" --allow-run-as-root --oversubscribe -np 2 "$bin" "${args[@]}" --layout tsp=2 --out "$tmp/killed_tsp" \
  --resume --stop-after $last >/dev/null
/usr/bin/python3 - "$tmp/killed_tsp" "$tmp/clean" $((from + 1)) $last <<'PY'
import json, sys
run, ref, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def losses(d):
    return {j["step"]: j["loss"] for j in map(json.loads, open(f"{d}/metrics.jsonl"))}
a, b = losses(run), losses(ref)
for step in range(first, last + 1):
    assert step in a and step in b, f"step {step} missing: {sorted(a)} / {sorted(b)}"
    rel = abs(a[step] - b[step]) / abs(b[step])
    assert rel <= 2e-5, f"step {step}: {a[step]!r} under tsp=2, {b[step]!r} under pp=2,tsp=2 ({rel:.2e})"
print(f"losses of steps {first}-{last}: resumed under tsp=2 == pp=2,tsp=2 within 2e-5")
PY
echo "resumed from step $from"

# 3. The launcher keeps the job running: the watchdog ends it and names the dead rank.
kill_rank3 "$tmp/recovery" 2 --enable-recovery
grep -q "watchdog: .*world 3 on $host): no answer\|watchdog: .*world rank 3 on $host: no answer" "$tmp/recovery.log" ||
  { cat "$tmp/recovery.log" >&2; die "the watchdog did not name world rank 3 on $host as dead"; }
echo "killed rank 3 in step $killed_in under --enable-recovery: the watchdog ended the job in $job_s s (timeout 2 s)"
grep -o "watchdog: .*" "$tmp/recovery.log" | head -1
