#!/usr/bin/env bash
# Layouts that cannot run: exit 2 with one foldpar line naming the numbers, on every rank
# count; nothing hangs.
set -u
mpirun=$1 bin=$2 src=$3
failures=0
check() {  # check NP "needle" args...
  local np=$1 needle=$2; shift 2
  local err
  err=$("$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$bin" "$@" 2>&1 >/dev/null)
  local rc=$?
  local lines
  lines=$(grep -c '^foldpar: error' <<<"$err")
  if [ "$rc" -eq 0 ] || [ "$lines" -ne 1 ] || ! grep -qF -- "$needle" <<<"$err"; then
    echo "FAIL: -np $np foldpar $* -> exit $rc, $lines foldpar error lines, wanted one containing '$needle':" >&2
    echo "$err" >&2
    failures=$((failures + 1))
  fi
}
check 3 "needs 4 ranks" verify --model "$src/configs/tiny.json" --layout tsp=4
check 3 "num_attention_heads (8) must be divisible by the TSP degree (3)" verify --model "$src/configs/tiny.json" --layout tsp=3
check 2 "sequence length (66)" verify --model "$src/configs/tiny.json" --layout tsp=2 --seq 66
check 2 "head buckets (3)" verify --model "$src/configs/tiny.json" --layout tsp=2 --head-buckets 3
check 2 "unknown" verify --model "$src/configs/tiny.json" --layout tensor=2
check 2 "bf16 storage cannot meet that" verify --model "$src/configs/tiny.json" --layout tsp=2:bf16
check 2 "--seq-split" verify --model "$src/configs/tiny.json" --layout tsp=2 --seq-split diagonal
exit $((failures > 0))
