#!/usr/bin/env bash
# A host's link is cut in the middle of training (tsp=2, one rank on each of two hosts,
# multihost_lib.sh). Asserts: every rank ends within the watchdog timeout plus a margin;
# mpirun exits non-zero soon after; its output names the cut-off rank and its host (rank 0's
# watchdog: "rank 1 (world 1 on fphost1): no answer"); no process is left on either host; and
# once the link is back, `train --resume` continues from the newest complete checkpoint with
# the losses of an undisturbed run.
set -euo pipefail
mpirun=$1 bin=$2 src=$3
here=$(cd "$(dirname "$0")" && pwd)
source "$here/faults_lib.sh"
source "$here/multihost_lib.sh"
tmp=$(mktemp -d)
trap 'mh_down; rm -rf "$tmp"' EXIT
timeout_s=3
export FOLDPAR_COMM_TIMEOUT=$timeout_s
"$bin" prepare-data --out "$tmp/data" >/dev/null
# A step takes milliseconds, so the job's horizon is 200 steps: it cannot finish between step
# 5's line and the cut. The resumed and the undisturbed runs stop 3 steps after the checkpoint.
args=(train --model "$src/configs/tiny.json" --data "$tmp/data" --layout tsp=2 --steps 200 --seq 64
      --batch 4 --eval-every 0 --eval-batches 1 --progress none --seed 3 --checkpoint-every 4)

mh_up 2
mh_mpirun -np 2 "$bin" "${args[@]}" --out "$tmp/cut" >"$tmp/cut.log" 2>&1 &
job=$!
wait_for_step "$tmp/cut/metrics.jsonl" 5 120 "$job"
mh_cut 1
cut_at=$(now)
# Both ranks stop by their watchdogs (each waits for the other).
until [ -z "$(mh_pids 0 foldpar)$(mh_pids 1 foldpar)" ]; do
  less_than "$(elapsed_since "$cut_at")" $((timeout_s + 15)) ||
    die "ranks still running $((timeout_s + 15)) s after the cut: $(mh_leftovers 0; mh_leftovers 1)"
  sleep 0.05
done
ranks_s=$(elapsed_since "$cut_at")
# mpirun and OpenMPI's daemon on the cut-off host go once TCP gives up (tcp_retries2=4).
rc=0
wait "$job" || rc=$?
job_s=$(elapsed_since "$cut_at")
[ "$rc" -ne 0 ] || die "mpirun exited 0 after the cut"
less_than "$job_s" $((timeout_s + 40)) || die "mpirun took $job_s s after the cut"
grep -q "rank 1 (world 1 on fphost1): no answer" "$tmp/cut.log" || { cat "$tmp/cut.log" >&2; die "no message naming rank 1 on fphost1"; }
grep -q "fatal on rank 0 on fphost0 .*watchdog" "$tmp/cut.log" || die "rank 0's watchdog report is missing"
sleep 1
left="$(mh_leftovers 0)$(mh_leftovers 1)"
[ -z "$left" ] || die "processes left on the hosts: $left"
echo "link cut: ranks ended after $ranks_s s, mpirun (exit $rc) after $job_s s (watchdog timeout $timeout_s s)"
grep "no answer" "$tmp/cut.log" | head -1

# Link back; resume from the newest complete checkpoint; compare with an undisturbed run.
mh_mend 1
from=$(newest_checkpoint "$tmp/cut/checkpoints")
[ "$from" -ge 4 ] || die "no checkpoint before the cut"
mh_mpirun -np 2 "$bin" "${args[@]}" --out "$tmp/cut" --resume --stop-after $((from + 3)) >/dev/null
"$mpirun" --allow-run-as-root --oversubscribe -np 2 "$bin" "${args[@]}" --out "$tmp/clean" \
  --stop-after $((from + 3)) >/dev/null
same_losses "$tmp/cut" "$tmp/clean" $((from + 1)) $((from + 3))
echo "resumed over both hosts from step $from"
