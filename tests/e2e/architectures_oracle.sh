#!/usr/bin/env bash
# The architecture variants of the Hugging Face families (issue 21) against the PyTorch
# reference (scripts/torch_reference.py, fp64, the transformers formulas): loss, logits and
# every gradient on one rank, and under tsp=2 and tp=2 (their gradients assembled from the
# shards; `verify --layout` also checks them against the single-rank model), the attention
# variants (biases, q/k norms) included.
# RoPE scaling (linear, dynamic, llama3, yarn): the sequence (80) outruns each config's
# pretrained context, so every type's scaling is active. head_dim independent of h / n_h
# (h = 64, n_h = 8): 12 (q width 96 > h) and 4 (32 < h), also on the 2-D mesh. Mistral's
# sliding window on one rank, tsp=2, tp=2 and sp=2. One KV head (KV replicas) on tsp=2, tp=2.
# Llama's mlp_bias on one rank, tsp=2, tp=2 and tp=2,sp=2.
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { "$mpirun" --allow-run-as-root --oversubscribe "$@"; }
declare -A scaling=(
  [linear]='{"rope_type": "linear", "factor": 4.0}'
  [dynamic]='{"rope_type": "dynamic", "factor": 2.0}'
  [llama3]='{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}'
  [yarn]='{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8, "beta_slow": 1}'
)
# tiny.json with the given fields (JSON object) -> $tmp/NAME.json
variant() {
  /usr/bin/python3 - "$src/configs/tiny.json" "$tmp/$1.json" "$2" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(json.loads(sys.argv[3]))
json.dump(c, open(sys.argv[2], "w"))
PY
}
# NAME LAYOUT...: verify --dump on one rank and each layout (2 ranks, 4 for a 2-D one); the
# dumps are checked against PyTorch together at the end (tests/e2e/torch_oracle_many.py: one
# import of torch for all of them).
dumps=()
check() {
  local name=$1
  shift
  "$bin" verify --model "$tmp/$name.json" --batch 2 --seq 80 --seed 5 --dump "$tmp/$name-1" >/dev/null
  dumps+=("$tmp/$name-1")
  for layout in "$@"; do
    local np=2
    [[ $layout == *,* ]] && np=4
    run -np $np "$bin" verify --model "$tmp/$name.json" --layout "$layout" --batch 2 --seq 80 --seed 5 \
      --dump "$tmp/$name-$layout" >/dev/null
    dumps+=("$tmp/$name-$layout")
  done
}
for type in linear dynamic llama3 yarn; do
  variant "$type" "{\"max_position_embeddings\": 32, \"rope_theta\": 1e6, \"rope_scaling\": ${scaling[$type]}}"
  check "$type" tsp=2 tp=2
done
variant head_dim12 '{"head_dim": 12}'
check head_dim12 tsp=2 tp=2 sp=2 tp=2,sp=2
variant head_dim4 '{"head_dim": 4}'
check head_dim4 tsp=2 tp=2
# One KV head for 8 query heads (fewer KV heads than ranks: each rank a replica of it,
# docs/tsp.md section 3) on tsp=2 and tp=2.
variant one_kv_head '{"num_key_value_heads": 1}'
check one_kv_head tsp=2 tp=2
# Llama's mlp_bias (gate/up/down biases), with attention_bias: replicated like the attention
# biases on the layouts.
variant llama_mlp_bias '{"mlp_bias": true, "attention_bias": true}'
check llama_mlp_bias tsp=2 tp=2 tp=2,sp=2
# Mistral's sliding window (9 < the sequence's 80): zigzag TSP, TP and the sequence ring.
variant mistral_window '{"model_type": "mistral", "sliding_window": 9}'
check mistral_window tsp=2 tp=2 sp=2
# Attention variants (issue 21), nonzero random biases and q/k gains (init_weights): Qwen2's
# q/k/v biases, Llama's attention_bias (q/k/v/o), Qwen3's per-head q/k RMSNorm with head_dim
# 12 != h / n_h = 8 (with attention_bias too): on one rank, on tsp=2 and tp=2, and qwen3 with
# biases on the 2-D mesh. The one-rank dumps are checked here (naming the bias and norm
# gradients), the layouts' with the others in one oracle process (torch starts once).
variant qwen2 '{"model_type": "qwen2", "use_sliding_window": false, "sliding_window": 4096}'
variant llama_bias '{"attention_bias": true}'
variant qwen3 '{"model_type": "qwen3", "head_dim": 12}'
variant qwen3_bias '{"model_type": "qwen3", "head_dim": 12, "attention_bias": true}'
qdumps=()
for name in qwen2 llama_bias qwen3 qwen3_bias; do
  "$bin" verify --model "$tmp/$name.json" --batch 2 --seq 80 --seed 5 --dump "$tmp/$name-1" >/dev/null
  qdumps+=("$tmp/$name-1")
done
/usr/bin/python3 "$src/scripts/torch_reference.py" "${qdumps[@]}" >"$tmp/out" 2>&1 || { cat "$tmp/out"; exit 1; }
for want in "grad model.layers.1.self_attn.q_proj.bias" "grad model.layers.1.self_attn.o_proj.bias" \
            "grad model.layers.1.self_attn.q_norm.weight" "grad model.layers.1.self_attn.k_norm.weight"; do
  grep -qF "$want" "$tmp/out" || { echo "FAIL: the oracle did not compare $want"; cat "$tmp/out"; exit 1; }
done
[ "$(grep -c '^PASS' "$tmp/out")" -eq 4 ] || { echo "FAIL: wanted 4 passing dumps"; cat "$tmp/out"; exit 1; }
# The oracle sees the biases: qwen2's dump read as llama (no biases) must fail (checked with
# the others below, in one process).
cp -r "$tmp/qwen2-1" "$tmp/qwen2-as-llama"
sed 's/"qwen2"/"llama"/' "$tmp/qwen2-1/config.json" >"$tmp/qwen2-as-llama/config.json"
cmp -s "$tmp/qwen2-1/config.json" "$tmp/qwen2-as-llama/config.json" && { echo "FAIL: no qwen2 in qwen2's config"; exit 1; }
echo "qwen2, llama attention_bias, qwen3 (head_dim 12, with and without biases): single rank matches PyTorch"
for name in qwen2 llama_bias qwen3 qwen3_bias; do
  for layout in tsp=2 tp=2; do
    run -np 2 "$bin" verify --model "$tmp/$name.json" --layout "$layout" --batch 2 --seq 80 --seed 5 \
      --dump "$tmp/$name-$layout" >/dev/null
    dumps+=("$tmp/$name-$layout")
  done
done
run -np 4 "$bin" verify --model "$tmp/qwen3_bias.json" --layout tp=2,sp=2 --batch 2 --seq 80 --seed 5 \
  --dump "$tmp/qwen3_bias-tp=2,sp=2" >/dev/null
dumps+=("$tmp/qwen3_bias-tp=2,sp=2")
# (dp, pp and bf16 layouts: tests/e2e/train_variants.sh.)
# Training (AdamW over the biases and gains too): 8 steps of qwen3 with attention_bias on one
# rank, and the same steps as 4 under tsp=2 then 4 under tp=2 from its checkpoint, give the
# same losses (2e-5 relative, as tests/e2e/train_layouts.sh).
"$bin" prepare-data --out "$tmp/data" >/dev/null
train() {  # train NP LAYOUT OUT [extra flags]
  local np=$1 layout=$2 out=$3; shift 3
  run -np "$np" "$bin" train --model "$tmp/qwen3_bias.json" --data "$tmp/data" --out "$out" --layout "$layout" \
    --steps 8 --seq 64 --batch 4 --lr 3e-3 --warmup 2 --eval-every 0 --eval-batches 1 --print-every 100 --seed 7 \
    "$@" >/dev/null
}
train 1 tsp=1 "$tmp/train-1"
train 2 tsp=2 "$tmp/train-resume" --stop-after 4
train 2 tp=2 "$tmp/train-resume" --resume
/usr/bin/python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def losses(name):
    return [json.loads(l)["loss"] for l in open(f"{tmp}/{name}/metrics.jsonl")]
want = losses("train-1")
assert len(want) == 8 and want[-1] < want[0], want
for name in ["train-resume"]:
    got = losses(name)
    assert len(got) == 8, (name, len(got))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert worst <= 2e-5, f"{name}: losses differ from one rank's by {worst:.2e}"
PY
echo "qwen3 with attention_bias trains alike on one rank and on tsp=2 resumed under tp=2"
# The oracle itself tells the types apart: yarn's dump checked as linear must fail.
cp -r "$tmp/yarn-1" "$tmp/yarn-as-linear"
sed 's/"yarn"/"linear"/' "$tmp/yarn-1/config.json" >"$tmp/yarn-as-linear/config.json"
cmp -s "$tmp/yarn-1/config.json" "$tmp/yarn-as-linear/config.json" && { echo "FAIL: no yarn in yarn's config"; exit 1; }
# The oracle sees the window: the windowed dump checked as full causal must fail.
cp -r "$tmp/mistral_window-1" "$tmp/window-as-full"
sed 's/"sliding_window": 9/"sliding_window": null/' "$tmp/mistral_window-1/config.json" >"$tmp/window-as-full/config.json"
cmp -s "$tmp/mistral_window-1/config.json" "$tmp/window-as-full/config.json" && { echo "FAIL: no window in its config"; exit 1; }
# The oracle sees the MLP biases: the dump checked without them must fail.
cp -r "$tmp/llama_mlp_bias-1" "$tmp/mlp-bias-as-none"
sed 's/"mlp_bias": true/"mlp_bias": false/' "$tmp/llama_mlp_bias-1/config.json" >"$tmp/mlp-bias-as-none/config.json"
cmp -s "$tmp/llama_mlp_bias-1/config.json" "$tmp/mlp-bias-as-none/config.json" && { echo "FAIL: no mlp_bias in its config"; exit 1; }
# Every dump against PyTorch, and the wrong one (!) must fail.
/usr/bin/python3 "$src/tests/e2e/torch_oracle_many.py" "$src" "${dumps[@]}" "!$tmp/yarn-as-linear" \
  "!$tmp/qwen2-as-llama" "!$tmp/window-as-full" "!$tmp/mlp-bias-as-none" >"$tmp/out" 2>&1 || { cat "$tmp/out"; exit 1; }
echo "${#dumps[@]} dumps (single rank and layouts of every variant) match PyTorch; yarn's checked as linear,"
echo "qwen2's as llama, the sliding window's as full causal and mlp_bias's without its biases fail"
# A rope_scaling type foldpar does not implement: one line naming it, exit 2.
variant longrope '{"rope_scaling": {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0]}}'
set +e
"$bin" verify --model "$tmp/longrope.json" >"$tmp/out" 2>"$tmp/err"
rc=$?
set -e
if [ "$rc" -ne 2 ] || [ "$(wc -l <"$tmp/err")" -ne 1 ] || ! grep -qF 'rope_scaling type "longrope" is not supported' "$tmp/err"; then
  echo "FAIL: longrope: exit $rc, wanted 2 and one line naming the type:"; cat "$tmp/err"; exit 1
fi
echo "architectures_oracle: RoPE scaling types, head_dim and attention variants match PyTorch; a wrong type is caught"
