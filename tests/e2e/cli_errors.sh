#!/usr/bin/env bash
# Bad flags and bad configs: each must exit 2 with exactly one line on stderr that names the
# problem, and nothing may crash.
set -u
bin=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '{"hidden_size": 64, "num_attention_heads": 6, "intermediate_size": 8, "num_hidden_layers": 1, "vocab_size": 10}' >"$tmp/heads.json"
printf '{"hidden_size": 64,' >"$tmp/truncated.json"
printf '' >"$tmp/empty.json"
failures=0
check() {  # check "needle" args...
  local needle=$1; shift
  "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  local lines
  lines=$(wc -l <"$tmp/err")
  if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || ! grep -qF -- "$needle" "$tmp/err"; then
    echo "FAIL: foldpar $* -> exit $rc, $lines stderr lines, wanted exit 2 and one line containing '$needle':" >&2
    cat "$tmp/err" >&2
    failures=$((failures + 1))
  fi
}
check "subcommand is required"
check "--bogus" verify --model "$src/configs/tiny.json" --bogus
check "--model is required" verify
check "cannot be opened" verify --model "$tmp/missing.json"
check "num_attention_heads (6)" verify --model "$tmp/heads.json"
check "not valid JSON" verify --model "$tmp/truncated.json"
check "not valid JSON" verify --model "$tmp/empty.json"
check "--seq (0)" verify --model "$src/configs/tiny.json" --seq 0
check "--seq" verify --model "$src/configs/tiny.json" --seq abc
check "--recompute" verify --model "$src/configs/tiny.json" --recompute sometimes
check "--tolerance (-1)" verify --model "$src/configs/tiny.json" --tolerance -1
check "--threads (0)" bench --model "$src/configs/tiny.json" --threads 0
check "steps (0)" bench --model "$src/configs/tiny.json" --steps 0
check "cannot create dump directory" verify --model "$src/configs/tiny.json" --dump /proc/foldpar-dump
exit $((failures > 0))
