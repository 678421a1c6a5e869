#!/usr/bin/env bash
# --device where it cannot run: exit 2 with exactly one foldpar line that names the problem,
# on one rank and under mpirun, for train, bench and generate. Which line is right depends
# on the build, passed by CMake as the fourth argument:
#  - cpu-only (FOLDPAR_WITH_CUDA=OFF): foldpar has no CUDA and says how to build it;
#  - cuda (FOLDPAR_WITH_CUDA=ON): foldpar links CUDA; on a machine without a GPU it says so
#    with the driver's reason. Where a GPU is visible the device opens, so that half does not
#    apply: the test exits 77 (skipped) after the checks that hold everywhere; tests/gpu
#    covers that machine.
# An unknown device and --device with bench --layouts fail alike in both builds.
set -u
mpirun=$1 bin=$2 src=$3 build=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
model="$src/configs/tiny.json"
failures=0
check() {  # check NP "needle" args...   (NP 0: no mpirun)
  local np=$1 needle=$2; shift 2
  local err rc lines
  if [ "$np" = 0 ]; then
    err=$("$bin" "$@" 2>&1 >/dev/null)
  else
    err=$("$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$bin" "$@" 2>&1 >/dev/null)
  fi
  rc=$?
  lines=$(grep -c '^foldpar: error' <<<"$err")
  if { [ "$np" = 0 ] && [ "$rc" -ne 2 ]; } || [ "$rc" -eq 0 ] || [ "$lines" -ne 1 ] ||
     ! grep -qF -- "$needle" <<<"$err"; then
    echo "FAIL: -np $np foldpar $* -> exit $rc, $lines foldpar error lines, wanted one containing '$needle':" >&2
    echo "$err" >&2
    failures=$((failures + 1))
  fi
}
train=(train --model "$model" --data "$tmp/no-data" --out "$tmp/out" --steps 2 --progress none)
generate=(generate --hf "$tmp/no-model" --prompt hello)

unknown="--device: must be cpu or cuda, got 'tpu'"
check 0 "$unknown" "${train[@]}" --device tpu
check 0 "$unknown" bench --model "$model" --device tpu
check 0 "$unknown" "${generate[@]}" --device tpu
check 2 "$unknown" "${train[@]}" --device tpu
check 0 "bench --layouts and --calibrate run on the CPU only, not --device cuda" \
  bench --model "$model" --layouts tsp=1 --device cuda

case "$build" in
  cpu-only)
    want="--device cuda: this foldpar was built without CUDA; configure with -DFOLDPAR_WITH_CUDA=ON"
    ;;
  cuda)
    # Where a GPU opens, bench stops at its next check (steps (0)): nothing below applies.
    err=$("$bin" bench --model "$model" --steps 0 --device cuda 2>&1 >/dev/null)
    if grep -qF -- "steps (0)" <<<"$err"; then
      [ "$failures" -eq 0 ] || exit 1
      echo "SKIP: a GPU is visible, so --device cuda opens it; the no-GPU message cannot be checked here"
      exit 77
    fi
    want="--device cuda: no usable GPU (cudaGetDeviceCount"  # then the driver's words
    ;;
  *)
    echo "device_errors.sh: unknown build '$build' (cpu-only or cuda)" >&2
    exit 1
    ;;
esac
check 0 "$want" "${train[@]}" --device cuda
check 0 "$want" bench --model "$model" --device cuda
check 0 "$want" "${generate[@]}" --device cuda
check 2 "$want" "${train[@]}" --device cuda
check 2 "$want" "${generate[@]}" --device cuda
exit $((failures > 0))
