#!/usr/bin/env bash
# One rank of a tsp=2 training job is killed (SIGKILL) in the middle of a training step.
#  1. Plain mpirun, rank 1 and then rank 0 (the rank that writes metrics and prints): it
#     notices the death and ends the job. Asserts: mpirun exits non-zero
#     within the watchdog timeout plus a margin, its message names the rank and the host,
#     no process of the job is left, and `train --resume` continues from the newest complete
#     checkpoint with the losses of an undisturbed run.
#  2. mpirun --enable-recovery, which lets the job run on after a death (as some launchers
#     do): the surviving rank's watchdog ends it, naming the dead rank and its host; same
#     assertions (OpenMPI 4.1's mpirun exits 0 in this mode, so "rank 0 never finished"
#     stands in for its exit status).
set -euo pipefail
mpirun=$1 bin=$2 src=$3
here=$(cd "$(dirname "$0")" && pwd)
source "$here/faults_lib.sh"
tmp=$(mktemp -d)
trap 'for p in $(pgrep -f -- "$tmp/"); do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT
host=$(hostname)
"$bin" prepare-data --out "$tmp/data" >/dev/null
# A step takes 20-60 ms here, so the killed jobs' horizon is 200 steps: none can finish in
# the moment between step 5's line and the kill. A resumed run stops 3 steps after the
# checkpoint it resumed from (--stop-after), and is compared with an undisturbed run to there.
args=(train --model "$src/configs/tiny.json" --data "$tmp/data" --layout tsp=2 --steps 200 --seq 256
      --batch 16 --eval-every 0 --eval-batches 1 --progress none --seed 3 --checkpoint-every 4)
train() { "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$@"; }

# resume_and_compare OUT: resumes OUT from its newest complete checkpoint (sets from) for 3
# steps and asserts its losses equal an undisturbed run's bit for bit.
resume_and_compare() {
  from=$(newest_checkpoint "$1/checkpoints")
  [ "$from" -ge 4 ] || die "no checkpoint before the kill in $1"
  train "$bin" "${args[@]}" --out "$1" --resume --stop-after $((from + 3)) >/dev/null
  rm -rf "$tmp/clean"
  train "$bin" "${args[@]}" --out "$tmp/clean" --stop-after $((from + 3)) >/dev/null
  same_losses "$1" "$tmp/clean" $((from + 1)) $((from + 3))
}

# kill_rank OUT TIMEOUT RANK [mpirun flags]: starts the job, kills RANK as soon as step 5 is
# done, waits for mpirun; sets killed_in (the step it died in), job_s (seconds from the kill
# to mpirun's exit) and job_rc.
kill_rank() {
  local out=$1 timeout=$2 rank=$3
  shift 3
  FOLDPAR_COMM_TIMEOUT=$timeout train "$@" "$bin" "${args[@]}" --out "$out" >"$out.log" 2>&1 &
  kill_rank_of_job $! "$out" "$timeout" "$rank" 5
}
kill_rank_1() { kill_rank "$1" "$2" 1 "${@:3}"; }

# 1. mpirun ends the job.
kill_rank_1 "$tmp/killed" 30
[ "$job_rc" -ne 0 ] || die "mpirun exited 0 after a rank was killed"
# (OpenMPI 4.1 prints "PID 0" here.)
grep -Eq "mpi(run|exec) noticed that process rank 1 with PID [0-9]* on node $host exited on signal 9" "$tmp/killed.log" ||
  { cat "$tmp/killed.log" >&2; die "mpirun's message does not name rank 1 on $host"; }
echo "killed rank 1 (pid $victim) in step $killed_in: the job ended in $job_s s, exit $job_rc"
resume_and_compare "$tmp/killed"
echo "resumed from step $from"

# 1b. Rank 0 dies: the same, naming rank 0; the losses rank 0 had written stay valid.
kill_rank "$tmp/killed0" 30 0
[ "$job_rc" -ne 0 ] || die "mpirun exited 0 after rank 0 was killed"
grep -Eq "mpi(run|exec) noticed that process rank 0 with PID [0-9]* on node $host exited on signal 9" "$tmp/killed0.log" ||
  { cat "$tmp/killed0.log" >&2; die "mpirun's message does not name rank 0 on $host"; }
echo "killed rank 0 (pid $victim) in step $killed_in: the job ended in $job_s s, exit $job_rc"
resume_and_compare "$tmp/killed0"
echo "resumed from step $from after rank 0 died"

# 2. The launcher keeps the job running: the watchdog ends it.
kill_rank_1 "$tmp/recovery" 3 --enable-recovery
grep -q "fatal on rank 0 on $host .*watchdog: .*rank 1 (world 1 on $host): no answer" "$tmp/recovery.log" ||
  { cat "$tmp/recovery.log" >&2; die "the watchdog did not name rank 1 on $host"; }
echo "killed rank 1 in step $killed_in under --enable-recovery: the watchdog ended the job in $job_s s (timeout 3 s)"
grep -o "watchdog: .*" "$tmp/recovery.log" | head -1
resume_and_compare "$tmp/recovery"
echo "resumed from step $from"
