#!/usr/bin/env bash
# Disk trouble under a tsp=2 training run, with real mounts (root; a test that cannot mount
# fails, it does not skip):
#  - a full disk: the checkpoint directory is a 2000 KiB tmpfs, where the step-4 checkpoint
#    (1.6 MB) fits and the step-8 one cannot;
#  - a read-only checkpoint directory: a read-only bind mount (as root, chmod would not stop
#    a write), while a resumed run reaches its next checkpoint.
# Asserts each time: exit 3 (an I/O failure) with one "foldpar: error:" line naming the OS
# error; the previous checkpoint is complete and unchanged, no partial one is left; and
# `train --resume` from it (its copy on a good disk) continues with the losses of an undisturbed run. (A rank whose
# file outgrows RLIMIT_FSIZE is tests/parallel/checkpoint_test.cc.)
set -euo pipefail
mpirun=$1 bin=$2 src=$3
here=$(cd "$(dirname "$0")" && pwd)
source "$here/faults_lib.sh"
tmp=$(mktemp -d)
mounts=()
cleanup() {
  local m
  for m in "${mounts[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
"$bin" prepare-data --out "$tmp/data" >/dev/null
args=(train --model "$src/configs/tiny.json" --data "$tmp/data" --layout tsp=2 --steps 12 --seq 64 --batch 4
      --eval-every 0 --eval-batches 1 --progress none --seed 3 --checkpoint-every 4)
train() { "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$bin" "${args[@]}" "$@"; }
train --out "$tmp/clean" >/dev/null

# expect_one_error_line LOG OS_ERROR: exit 3 was seen by the caller; one error line naming it.
expect_one_error_line() {
  local n
  n=$(grep -c "^foldpar: error:" "$1" || true)
  [ "$n" = 1 ] || { cat "$1" >&2; die "$n error lines, expected one"; }
  grep "^foldpar: error:" "$1" | grep -q "$2" || { cat "$1" >&2; die "the error does not say '$2'"; }
  grep "^foldpar: error:" "$1"
}

# checkpoint_intact DIR STEP: complete, and nothing partial beside it.
checkpoint_intact() {
  test -f "$1/step-0000000$2/manifest.json" || die "checkpoint $2 is gone"
  [ "$(newest_checkpoint "$1")" = "$2" ] || die "checkpoint $2 is not the newest"
  ls -a "$1" | grep -q incomplete && die "a partial checkpoint is left in $1"
  return 0
}

# resume_copy DIR STEP NAME: resume on a good disk from a copy of DIR's checkpoint STEP.
resume_copy() {
  mkdir -p "$tmp/$3/checkpoints"
  cp -r "$1/step-0000000$2" "$tmp/$3/checkpoints/"
  train --out "$tmp/$3" --resume >/dev/null
  same_losses "$tmp/$3" "$tmp/clean" $(($2 + 1)) 12
}

# A full disk.
mkdir -p "$tmp/full/checkpoints"
mount -t tmpfs -o size=2000k tmpfs "$tmp/full/checkpoints" || die "cannot mount a tmpfs (needs root)"
mounts+=("$tmp/full/checkpoints")
rc=0
train --out "$tmp/full" >"$tmp/full.log" 2>&1 || rc=$?
[ "$rc" = 3 ] || { cat "$tmp/full.log" >&2; die "a full disk gave exit $rc, expected 3"; }
expect_one_error_line "$tmp/full.log" "No space left on device"
checkpoint_intact "$tmp/full/checkpoints" 4
resume_copy "$tmp/full/checkpoints" 4 full_resumed

# A read-only checkpoint directory: step 4 written, then the directory turns read-only.
train --out "$tmp/ro" --stop-after 4 >/dev/null
checkpoint_intact "$tmp/ro/checkpoints" 4
sums=$(cd "$tmp/ro/checkpoints" && md5sum step-00000004/*)
mount --bind "$tmp/ro/checkpoints" "$tmp/ro/checkpoints" || die "cannot bind-mount (needs root)"
mounts+=("$tmp/ro/checkpoints")
mount -o remount,bind,ro "$tmp/ro/checkpoints" || die "cannot remount read-only"
touch "$tmp/ro/checkpoints/probe" 2>/dev/null && die "the read-only mount accepts writes"
rc=0
train --out "$tmp/ro" --resume >"$tmp/ro.log" 2>&1 || rc=$?
[ "$rc" = 3 ] || { cat "$tmp/ro.log" >&2; die "a read-only checkpoint directory gave exit $rc, expected 3"; }
expect_one_error_line "$tmp/ro.log" "Read-only file system"
[ "$(cd "$tmp/ro/checkpoints" && md5sum step-00000004/*)" = "$sums" ] || die "checkpoint 4 changed"
checkpoint_intact "$tmp/ro/checkpoints" 4
resume_copy "$tmp/ro/checkpoints" 4 ro_resumed
