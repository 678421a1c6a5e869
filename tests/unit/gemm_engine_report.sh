#!/usr/bin/env bash
# gemm_engine_report.sh FOLDPAR MODEL: `foldpar bench` with OpenBLAS forced onto its SSE3
# "Prescott" kernels must name that kernel as slow and unused, and the engine it runs on
# instead (oneDNN). Asserts the printed report, never a time.
set -u
foldpar=$1 model=$2
out=$(OPENBLAS_CORETYPE=Prescott "$foldpar" bench --model "$model" --seq 32 --steps 1 --warmup 0 2>&1)
rc=$?
fail() { echo "FAIL: $1" >&2; echo "$out" >&2; exit 1; }
[ "$rc" -eq 0 ] || fail "foldpar bench exited $rc"
grep -q '^gemm onednn (onednn isa [a-z0-9_]*), openblas core Prescott (slow for this cpu: unused; OPENBLAS_CORETYPE=[A-Za-z]* would fix it)' <<<"$out" ||
  fail "the report does not name the engine and the slow OpenBLAS core"
echo "ok: $(head -1 <<<"$out")"
