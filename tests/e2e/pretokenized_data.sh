#!/usr/bin/env bash
# prepare-data --input-format bin-u16|bin-u32|npy: token files written by NumPy give the same
# corpus as the text path (with the separator after each document: removing it leaves the
# text path's train.tokens and val.tokens exactly), training reads it, and malformed or
# out-of-vocabulary files exit 2 with one line naming the file, offset and value.
set -u
bin=$1 src=$2
py=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OPENBLAS_NUM_THREADS=1
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
refuse() {  # refuse "needle" args...
  local needle=$1; shift
  "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$? lines
  lines=$(wc -l <"$tmp/err")
  if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || ! grep -qF -- "$needle" "$tmp/err"; then
    fail "foldpar $* -> exit $rc, $lines stderr lines, wanted exit 2 and one line containing '$needle':"
    cat "$tmp/err" >&2
  fi
}
$py -c "import json; c=json.load(open('$src/configs/tiny.json')); c['vocab_size']=300; json.dump(c, open('$tmp/model.json','w'))"
head -c 30000 /usr/share/games/fortunes/fortunes >"$tmp/text.txt"
"$bin" prepare-data --input "$tmp/text.txt" --out "$tmp/from_text" >/dev/null || fail "the text path"

# The documents as prepare-data's text path splits them ("%" lines), as bytes, each followed
# by the separator 256, in every format NumPy writes.
$py - "$tmp" <<'PY' || fail "writing the token files"
import sys
import numpy as np
tmp = sys.argv[1]
docs, cur = [], b""
for line in open(f"{tmp}/text.txt", "rb").read().split(b"\n")[:-1]:
    if line == b"%":
        if cur: docs.append(cur)
        cur = b""
    else:
        cur += line + b"\n"
if cur: docs.append(cur)
ids = np.concatenate([np.append(np.frombuffer(d, dtype=np.uint8).astype(np.int64), 256) for d in docs])
for dt in ["<u2", "<u4", "<i4", "<i8", "<u8"]:
    np.save(f"{tmp}/tokens{dt[1:]}.npy", ids.astype(dt))
n = len(ids) // 7 * 7
np.save(f"{tmp}/tokens2d.npy", ids[:n].astype("<u2").reshape(7, -1))
ids.astype("<u2").tofile(f"{tmp}/tokens.u16.bin")
ids.astype("<u4").tofile(f"{tmp}/tokens.u32.bin")
# Two files split inside a document: the first file's end ends that document.
cut = len(docs[0]) + 1 + len(docs[1]) // 2
ids[:cut].astype("<u2").tofile(f"{tmp}/part1.bin")
ids[cut:].astype("<u2").tofile(f"{tmp}/part2.bin")
# Refusals.
bad = ids[:100].copy(); bad[37] = 300
np.save(f"{tmp}/oov.npy", bad.astype("<u2"))
bad.astype("<u2").tofile(f"{tmp}/oov.bin")
np.save(f"{tmp}/negative.npy", np.array([1, 2, -5], dtype="<i4"))
np.save(f"{tmp}/big_endian.npy", ids[:100].astype(">u2"))
np.save(f"{tmp}/float.npy", ids[:100].astype("<f4"))
np.save(f"{tmp}/fortran.npy", np.asfortranarray(ids[:100].astype("<u2").reshape(10, 10)))
data = open(f"{tmp}/tokensu2.npy", "rb").read()
open(f"{tmp}/truncated.npy", "wb").write(data[:-1])
open(f"{tmp}/bad_magic.npy", "wb").write(b"\x93NUMPZ" + data[6:])
open(f"{tmp}/odd.bin", "wb").write(b"\x01\x00\x02")
PY

# train.tokens / val.tokens of DIR without the separators must equal the text path's.
same_as_text() {  # same_as_text DIR SEPARATORS-EXPECTED(yes|no)
  $py - "$tmp/from_text" "$1" <<'PY'
import json, sys
import numpy as np
def ids(path):
    b = open(path, "rb").read()
    assert b[:8] == b"FPTOKENS", path
    width, count = int.from_bytes(b[16:20], "little"), int.from_bytes(b[24:32], "little")
    return np.frombuffer(b[32:], dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[width])[:count].astype(np.int64)
text, toks = sys.argv[1], sys.argv[2]
info = json.load(open(f"{toks}/data.json"))
if info["vocab_size"] != 300:
    sys.exit(f"{toks}: vocabulary {info['vocab_size']}, not the model's 300")
docs = info["documents"]
if docs != json.load(open(f"{text}/data.json"))["documents"]:
    sys.exit(f"{toks}: {docs} documents, the text path {json.load(open(f'{text}/data.json'))['documents']}")
for split in ["train", "val"]:
    a, b = ids(f"{text}/{split}.tokens"), ids(f"{toks}/{split}.tokens")
    if not np.array_equal(a, b[b != 256]):
        sys.exit(f"{toks}/{split}.tokens without its separators differs from the text path's")
    if (b == 256).sum() == 0:
        sys.exit(f"{toks}/{split}.tokens has no separators")
PY
}
for f in npy:tokensu2.npy npy:tokensu4.npy npy:tokensi4.npy npy:tokensi8.npy npy:tokensu8.npy bin-u16:tokens.u16.bin bin-u32:tokens.u32.bin; do
  fmt=${f%%:*} file=${f#*:}
  out="$tmp/from_${file//./_}"
  if "$bin" prepare-data --input "$tmp/$file" --input-format "$fmt" --separator-token 256 --model "$tmp/model.json" \
      --out "$out" >"$tmp/out" 2>&1; then
    same_as_text "$out" || fail "$file ($fmt) differs from the text path"
  else
    fail "prepare-data of $file ($fmt):"; cat "$tmp/out" >&2
  fi
done
"$bin" prepare-data --input "$tmp/part1.bin" "$tmp/part2.bin" --input-format bin-u16 --separator-token 256 \
  --model "$tmp/model.json" --out "$tmp/parts" >"$tmp/out" 2>&1 || { fail "two files:"; cat "$tmp/out" >&2; }
want=$($py -c "import json; print(json.load(open('$tmp/from_text/data.json'))['documents'] + 1)")
got=$($py -c "import json; print(json.load(open('$tmp/parts/data.json'))['documents'])")
[ "$got" = "$want" ] || fail "two files split inside a document: $got documents, want $want"
"$bin" prepare-data --input "$tmp/tokens2d.npy" --input-format npy --separator-token 256 --model "$tmp/model.json" \
  --out "$tmp/2d" >"$tmp/out" 2>&1 || { fail "a 2-D array:"; cat "$tmp/out" >&2; }
"$bin" train --model "$tmp/model.json" --data "$tmp/from_tokensu2_npy" --out "$tmp/run" --steps 2 --seq 32 --batch 2 \
  --progress none --layout tsp=1 >"$tmp/out" 2>&1 || { fail "training on a pretokenized corpus:"; cat "$tmp/out" >&2; }

p=(prepare-data --separator-token 256 --model "$tmp/model.json" --out "$tmp/refused")
refuse "$tmp/oov.npy: token 300 at byte offset $((128 + 37 * 2)) is not below the vocabulary size 300" "${p[@]}" --input "$tmp/oov.npy" --input-format npy
refuse "$tmp/oov.bin: token 300 at byte offset 74 is not below the vocabulary size 300" "${p[@]}" --input "$tmp/oov.bin" --input-format bin-u16
refuse "$tmp/negative.npy: token -5 at byte offset 136 is negative" "${p[@]}" --input "$tmp/negative.npy" --input-format npy
refuse "$tmp/big_endian.npy: the .npy array is big-endian (descr '>u2')" "${p[@]}" --input "$tmp/big_endian.npy" --input-format npy
refuse "$tmp/float.npy: .npy descr '<f4' is not a token type" "${p[@]}" --input "$tmp/float.npy" --input-format npy
refuse "$tmp/fortran.npy: the .npy array has fortran_order True" "${p[@]}" --input "$tmp/fortran.npy" --input-format npy
refuse "$tmp/truncated.npy: the .npy array holds" "${p[@]}" --input "$tmp/truncated.npy" --input-format npy
refuse "$tmp/bad_magic.npy: not a .npy file (bad magic)" "${p[@]}" --input "$tmp/bad_magic.npy" --input-format npy
refuse "$tmp/odd.bin: 3 bytes is not a whole number of 2-byte tokens (bin-u16)" "${p[@]}" --input "$tmp/odd.bin" --input-format bin-u16
refuse "unknown --input-format 'csv'" "${p[@]}" --input "$tmp/odd.bin" --input-format csv
refuse "--separator-token (300) must be given and below the vocabulary size 300" prepare-data --separator-token 300 \
  --model "$tmp/model.json" --out "$tmp/refused" --input "$tmp/tokens.u16.bin" --input-format bin-u16
refuse "--separator-token (-1) must be given" prepare-data --model "$tmp/model.json" --out "$tmp/refused" \
  --input "$tmp/tokens.u16.bin" --input-format bin-u16
refuse "--input-format bin-u16 needs the model's vocabulary (--model)" prepare-data --separator-token 256 \
  --out "$tmp/refused" --input "$tmp/tokens.u16.bin" --input-format bin-u16
[ ! -e "$tmp/refused" ] || fail "a refused input left $tmp/refused behind"
if [ "$failures" -ne 0 ]; then exit 1; fi
echo "pretokenized_data: 7 formats equal the text path; 13 refusals"
