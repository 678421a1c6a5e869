#!/usr/bin/env bash
# cmake/nccl.cmake finds NCCL as the GPU machine has it: Python's wheel layout
# (site-packages/nvidia/nccl/lib/libnccl.so.2, no unversioned name, include/nccl.h beside),
# through the python3 on PATH and through FOLDPAR_NCCL_ROOT; and stops with a message that
# names FOLDPAR_NCCL_ROOT when there is none. Fake files: find_library only needs the name.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
wheel=$tmp/site-packages/nvidia/nccl
mkdir -p "$wheel/lib" "$wheel/include" "$tmp/bin" "$tmp/other/lib" "$tmp/other/include"
touch "$wheel/lib/libnccl.so.2" "$wheel/include/nccl.h" "$tmp/other/lib/libnccl.so.2" "$tmp/other/include/nccl.h"
cat >"$tmp/bin/python3" <<PY
#!/bin/sh
echo "$tmp/site-packages"
PY
chmod +x "$tmp/bin/python3"
run() {  # run NAME [env...]: configures into $tmp/NAME, prints the NCCL line or the error
  local name=$1; shift
  env "$@" cmake -S "$here" -B "$tmp/$name" >"$tmp/$name.log" 2>&1 || true
  grep -E 'NCCL: |NCCL not found' "$tmp/$name.log" || echo "(no NCCL line)"
}
got=$(run wheel PATH="$tmp/bin:$PATH")
[[ $got == "-- NCCL: $wheel/lib/libnccl.so.2, $wheel/include" ]] || { echo "FAIL wheel: $got"; exit 1; }
got=$(run root PATH="$tmp/bin:$PATH" FOLDPAR_NCCL_ROOT="$tmp/other")
[[ $got == "-- NCCL: $tmp/other/lib/libnccl.so.2, $tmp/other/include" ]] || { echo "FAIL FOLDPAR_NCCL_ROOT: $got"; exit 1; }
printf '#!/bin/sh\necho /nonexistent\n' >"$tmp/bin/python3"
if [ ! -e /usr/lib/x86_64-linux-gnu/libnccl.so.2 ] && [ ! -e /usr/local/lib/libnccl.so.2 ]; then
  got=$(run none PATH="$tmp/bin:$PATH")
  [[ $got == *"NCCL not found"* ]] && grep -q FOLDPAR_NCCL_ROOT "$tmp/none.log" || { echo "FAIL none: $got"; exit 1; }
fi
echo "PASS: wheel layout via python3, FOLDPAR_NCCL_ROOT, and the error without NCCL"
