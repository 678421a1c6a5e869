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
# The yardsticks: the faster engine's GEMM rate beside both engines', and the ISA peak with how
# it was computed (format only: a time is never asserted).
grep -Eq '^best gemm 1024x1024x1024 f32 [0-9.]+ GFLOP/s \((openblas|onednn); openblas [0-9.]+, onednn [0-9.]+\)$' <<<"$out" ||
  fail "no best-gemm yardstick line"
grep -Eq '^isa peak [0-9.]+ GFLOP/s f32 = [0-9.]+ GHz \(measured: dependent integer multiplies\) x (4|8|16) lanes x 2 \(fma\) x [12] fma units' <<<"$out" ||
  fail "no isa-peak line"
grep -Eq '^seq +batch +step s +tokens/s +GFLOP/s +peak MiB +of gemm +of peak$' <<<"$out" || fail "no yardstick columns"
echo "ok: $(head -3 <<<"$out")"
