#!/usr/bin/env bash
# --progress auto: a bar redrawn with carriage returns only when the user watches a terminal;
# stdout redirected to a file gets plain lines, with and without mpirun (whose ranks always
# write to a pseudo-terminal). On a terminal (script(1) provides one) the bar is drawn, so
# the file case cannot pass by never drawing.
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
die() { echo "FAIL: $*" >&2; exit 1; }
"$bin" prepare-data --out "$tmp/data" >/dev/null
args=(train --model "$src/configs/tiny.json" --data "$tmp/data" --steps 2 --seq 32 --batch 2 --eval-every 0
      --eval-batches 1 --print-every 1 --progress auto)

"$bin" "${args[@]}" --out "$tmp/plain" >"$tmp/plain.log" 2>&1
grep -q $'\r' "$tmp/plain.log" && die "--progress auto wrote carriage returns to a file: $(od -c "$tmp/plain.log" | head)"
grep -q "^step 2/2 " "$tmp/plain.log" || die "no progress lines in the file: $(cat "$tmp/plain.log")"

"$mpirun" --allow-run-as-root -np 1 "$bin" "${args[@]}" --out "$tmp/mpi" >"$tmp/mpi.log" 2>&1
grep -q $'\r' "$tmp/mpi.log" && die "under mpirun, --progress auto wrote carriage returns to a file"
grep -q "^step 2/2 " "$tmp/mpi.log" || die "no progress lines under mpirun: $(cat "$tmp/mpi.log")"

# script(1) runs the command on a pseudo-terminal and copies what it shows into the file.
script -qec "$(printf '%q ' "$bin" "${args[@]}" --out "$tmp/tty")" "$tmp/tty.log" >/dev/null
grep -q $'\r\[#' "$tmp/tty.log" || die "on a terminal --progress auto drew no bar: $(od -c "$tmp/tty.log" | head)"
echo "--progress auto: lines into files (with and without mpirun), a bar on a terminal"
