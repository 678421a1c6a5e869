# Sourced by the reliability e2e tests (faults_*.sh, disk_faults.sh, multihost*.sh): waiting
# for a training step, finding a rank's pid, and comparing losses with an undisturbed run.

die() {
  echo "FAILED: $*" >&2
  exit 1
}

now() { date +%s.%N; }
elapsed_since() { /usr/bin/python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }
# less_than A B: A < B as decimals.
less_than() { /usr/bin/python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < float(sys.argv[2]) else 1)" "$1" "$2"; }

# wait_for_step METRICS STEP LIMIT_S PID: until metrics.jsonl holds STEP, or fail after LIMIT_S
# seconds or when PID (the job) has ended first.
wait_for_step() {
  local metrics=$1 step=$2 limit=$3 pid=$4 start
  start=$(now)
  until grep -q "\"step\":$step," "$metrics" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || die "the job ended before step $step"
    less_than "$(elapsed_since "$start")" "$limit" || die "no step $step within $limit s"
    sleep 0.05
  done
}

# rank_pid MARKER RANK: the pid of the MPI rank RANK of the job whose command line holds
# MARKER (mpirun's own command line holds it too, but not OMPI_COMM_WORLD_RANK).
rank_pid() {
  local pid
  for pid in $(pgrep -f -- "$1"); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2"; then
      echo "$pid"
      return 0
    fi
  done
  return 1
}

# no_process_left MARKER: nothing with MARKER in its command line remains (polled 5 s, since
# an exiting process keeps its command line until it is reaped).
no_process_left() {
  local i
  for ((i = 0; i < 100; i++)); do
    pgrep -f -- "$1" >/dev/null || return 0
    sleep 0.05
  done
  die "processes left behind: $(pgrep -a -f -- "$1" | tr '\n' ';')"
}

# newest_checkpoint DIR: the step number of the newest complete checkpoint under DIR.
newest_checkpoint() {
  local d best=
  for d in "$1"/step-*; do
    [ -f "$d/manifest.json" ] && best=${d##*step-}
  done
  [ -n "$best" ] || die "no complete checkpoint under $1"
  echo $((10#$best))
}

# same_losses RUN REFERENCE FIRST LAST: metrics.jsonl of RUN (its last line per step wins: a
# resumed run repeats steps) equals REFERENCE's at every step FIRST..LAST, bit for bit.
same_losses() {
  /usr/bin/python3 - "$@" <<'PY'
import json, sys
run, ref, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def losses(d):
    out = {}
    for line in open(f"{d}/metrics.jsonl"):
        j = json.loads(line)
        out[j["step"]] = j["loss"]
    return out
a, b = losses(run), losses(ref)
for step in range(first, last + 1):
    assert step in a and step in b, f"step {step} missing: {sorted(a)} / {sorted(b)}"
    assert a[step] == b[step], f"step {step}: {a[step]!r} in {run}, {b[step]!r} in {ref}"
print(f"losses of steps {first}-{last}: {run.split('/')[-1]} == {ref.split('/')[-1]}, bit for bit")
PY
}

# kill_rank_of_job JOB OUT TIMEOUT RANK STEP: for a training job just started in the
# background (mpirun's pid JOB, --out OUT, watchdog TIMEOUT s), kills RANK as soon as step
# STEP is done and waits for mpirun; sets victim, killed_in (the step it died in), job_s
# (seconds from the kill to mpirun's exit) and job_rc. Dies if the job outlives the watchdog
# by 15 s, leaves a process behind, or rank 0 finishes training.
kill_rank_of_job() {
  local job=$1 out=$2 timeout=$3 rank=$4 step=$5 start killed_at
  start=$(now)
  until victim=$(rank_pid "--out $out" "$rank"); do
    less_than "$(elapsed_since "$start")" 60 || die "rank $rank of $out not found"
    sleep 0.05
  done
  wait_for_step "$out/metrics.jsonl" "$step" 120 "$job"
  kill -9 "$victim"
  killed_at=$(now)
  killed_in=$(($(wc -l <"$out/metrics.jsonl") + 1))
  job_rc=0
  wait "$job" || job_rc=$?
  job_s=$(elapsed_since "$killed_at")
  less_than "$job_s" $((timeout + 15)) || die "the job took $job_s s to end (watchdog timeout $timeout s)"
  no_process_left "--out $out"
  grep -q "trained to step" "$out.log" && die "rank 0 finished training after rank $rank died"
  return 0
}
