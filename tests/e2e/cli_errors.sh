#!/usr/bin/env bash
# Bad flags and bad configs: each must exit 2 with exactly one line on stderr that names the
# problem, and nothing may crash. A write the OS refuses is an I/O failure: exit 3.
set -u
bin=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '{"hidden_size": 64, "num_attention_heads": 6, "intermediate_size": 8, "num_hidden_layers": 1, "vocab_size": 10}' >"$tmp/heads.json"
printf '{"hidden_size": 64,' >"$tmp/truncated.json"
printf '' >"$tmp/empty.json"
failures=0
check_exit() {  # check_exit CODE "needle" args...
  local want=$1 needle=$2; shift 2
  "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  local lines
  lines=$(wc -l <"$tmp/err")
  if [ "$rc" -ne "$want" ] || [ "$lines" -ne 1 ] || ! grep -qF -- "$needle" "$tmp/err"; then
    echo "FAIL: foldpar $* -> exit $rc, $lines stderr lines, wanted exit $want and one line containing '$needle':" >&2
    cat "$tmp/err" >&2
    failures=$((failures + 1))
  fi
}
check() { check_exit 2 "$@"; }
check "subcommand is required"
check "--bogus" verify --model "$src/configs/tiny.json" --bogus
check "--model is required" verify
check "--model: File does not exist: $tmp/missing.json" verify --model "$tmp/missing.json"
check "num_attention_heads (6)" verify --model "$tmp/heads.json"
check "not valid JSON" verify --model "$tmp/truncated.json"
check "not valid JSON" verify --model "$tmp/empty.json"
check "--seq: must be positive, got 0" verify --model "$src/configs/tiny.json" --seq 0
check "--seq: must be a number, got 'abc'" verify --model "$src/configs/tiny.json" --seq abc
check "--recompute" verify --model "$src/configs/tiny.json" --recompute sometimes
check "--tolerance: must be at least 0, got -1" verify --model "$src/configs/tiny.json" --tolerance -1
check "--threads: must be positive, got 0" bench --model "$src/configs/tiny.json" --threads 0
check "steps (0)" bench --model "$src/configs/tiny.json" --steps 0
check "--recompute: must be none or block, got 'sometimes'" bench --model "$src/configs/tiny.json" --recompute sometimes
check "--progress: must be auto, bar, lines or none, got 'fancy'" train --model "$src/configs/tiny.json" --progress fancy
check "--bf16 and --f32 exclude each other" train --model "$src/configs/tiny.json" --bf16 --f32 --out "$tmp/run"
check "--f32 with the bf16 layout tsp=1:bf16" train --model "$src/configs/tiny.json" --layout tsp=1:bf16 --f32 --out "$tmp/run"
check "--device: must be cpu or cuda, got 'tpu'" generate --hf "$tmp" --prompt x --device tpu
check "no complete checkpoint in '$tmp'" export --checkpoint "$tmp" -o "$tmp/hf"
check "--layouts is required" bench-layouts --model "$src/configs/tiny.json"
check_exit 3 "cannot create dump directory" verify --model "$src/configs/tiny.json" --dump /proc/foldpar-dump
exit $((failures > 0))
