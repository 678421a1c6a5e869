#!/usr/bin/env bash
# foldpar train with the attention variants and KV replicas (issue 21) under data and
# pipeline parallelism, with real MPI processes and real files. The model is configs/tiny.json
# as Qwen3 with attention_bias (q/k/v/o biases and per-head q/k norms, all replicated) and
# one KV head (a replica of it on every model rank):
#  - the same 8 steps from the same seed give the same losses on one rank, dp=2,tsp=1
#    (accumulating 2 micro-batches), dp=2,tsp=2, dp=2,tp=2, pp=2,tsp=2, pp=2,tp=2 and
#    pp=2,dp=2,tsp=1 (m = 2 or 4): a bias or gain gradient summed over dp twice or not at all,
#    or a replica that drifts, moves the loss by far more than the tolerance within a step;
#  - a pp=2,tsp=2 checkpoint at step 4 resumed on one rank, and a dp=2,tsp=2 one resumed under
#    tp=2: the next losses match (the variants and replicas reshard through their ParamRefs);
#  - bf16 storage: dp=2,tsp=2 and pp=2,tp=2 follow one rank in bf16 (one bf16 ulp) and f32 (3%);
#  - Llama with attention_bias and mlp_bias (gate/up/down biases, replicated): tsp=2, tp=2:seqpar,
#    dp=2,tsp=2 and pp=2,tp=2 give one rank's losses, and a pp=2,tsp=2 checkpoint resumes on tp=2.
# Tolerance: 2e-5 relative, as train_layouts.sh (only the order of f32 sums differs).
set -euo pipefail
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
/usr/bin/python3 - "$src/configs/tiny.json" "$tmp/model.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": True,
          "num_key_value_heads": 1})
json.dump(c, open(sys.argv[2], "w"))
c = json.load(open(sys.argv[1]))
c.update({"attention_bias": True, "mlp_bias": True})
json.dump(c, open(sys.argv[2].replace("model.json", "mlp_bias.json"), "w"))
PY
model=$tmp/model.json
run() {  # run NP LAYOUT OUT [extra train flags]
  local np=$1 layout=$2 out=$3; shift 3
  "$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$bin" train --model "$model" \
    --data "$tmp/data" --out "$out" --layout "$layout" --steps 8 --seq 64 --batch 4 --lr 3e-3 --warmup 2 \
    --eval-every 0 --eval-batches 1 --print-every 100 --seed 7 "$@" >/dev/null
}
compare() {  # compare WANT GOT...: every run's 8 losses within 2e-5 of WANT's
  /usr/bin/python3 - "$tmp" "$@" <<'PY'
import json, sys
tmp, want, names = sys.argv[1], sys.argv[2], sys.argv[3:]
def losses(name):
    return [json.loads(l)["loss"] for l in open(f"{tmp}/{name}/metrics.jsonl")]
ref = losses(want)
assert len(ref) == 8, len(ref)
assert ref[-1] < ref[0] - 0.1, f"the loss should fall over 8 steps: {ref[0]} -> {ref[-1]}"
for name in names:
    got = losses(name)
    assert len(got) == 8, (name, len(got))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= 2e-5, f"{name}: losses differ from {want} by {worst:.2e} (relative)"
    print(f"{name}: worst relative difference from {want} {worst:.2e}")
PY
}
"$bin" prepare-data --out "$tmp/data" >/dev/null

run 1 tsp=1 "$tmp/one"
run 2 dp=2,tsp=1 "$tmp/dp2" --micro-batch 1
run 4 dp=2,tsp=2 "$tmp/dp2tsp2"
run 4 dp=2,tp=2 "$tmp/dp2tp2" --micro-batch 1
run 4 pp=2,tsp=2 "$tmp/pp2tsp2" --micro-batch 1
run 4 pp=2,tp=2 "$tmp/pp2tp2" --micro-batch 2
run 4 pp=2,dp=2,tsp=1 "$tmp/pp2dp2" --micro-batch 1
compare one dp2 dp2tsp2 dp2tp2 pp2tsp2 pp2tp2 pp2dp2

# Resharding: pp=2,tsp=2 stops at step 4 and one rank continues; dp=2,tsp=2 stops at step 4
# and tp=2 continues.
run 4 pp=2,tsp=2 "$tmp/from_pp" --micro-batch 1 --stop-after 4
run 1 tsp=1 "$tmp/from_pp" --resume
run 4 dp=2,tsp=2 "$tmp/from_dp" --stop-after 4
run 2 tp=2 "$tmp/from_dp" --resume
compare one from_pp from_dp

# bf16 storage (the biases and gains bf16 like the weights): dp=2,tsp=2 and pp=2,tp=2 against
# one rank in bf16 step by step within one bf16 ulp (2^-8 relative, as train_bf16.sh: the
# roundings sit elsewhere, the loss is a mean over 256 tokens), and against f32 within 3%.
run 1 tsp=1 "$tmp/one_bf16" --bf16
run 4 dp=2,tsp=2 "$tmp/dp2tsp2_bf16" --bf16
run 4 pp=2,tp=2 "$tmp/pp2tp2_bf16" --bf16 --micro-batch 2
/usr/bin/python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def losses(name):
    return [json.loads(l)["loss"] for l in open(f"{tmp}/{name}/metrics.jsonl")]
f32, b16 = losses("one"), losses("one_bf16")
assert len(b16) == 8 and b16[-1] < b16[0] - 0.1, b16
for name in ["one_bf16", "dp2tsp2_bf16", "pp2tp2_bf16"]:
    got = losses(name)
    assert len(got) == 8, (name, len(got))
    d = max(abs(a - b) / b for a, b in zip(got, b16))
    d32 = max(abs(a - b) / b for a, b in zip(got, f32))
    assert d < 2 ** -8, f"{name}: losses differ from one rank in bf16 by {d:.2e} (relative)"
    assert d32 < 0.03, f"{name}: losses differ from f32 by {d32:.3f} (relative)"
    print(f"{name}: worst loss difference {d:.2e} from one rank in bf16, {d32:.2e} from f32")
PY

model=$tmp/mlp_bias.json
run 1 tsp=1 "$tmp/mlp_one"
run 2 tsp=2 "$tmp/mlp_tsp2"
run 2 tp=2:seqpar "$tmp/mlp_tp2"
run 4 dp=2,tsp=2 "$tmp/mlp_dp2tsp2"
run 4 pp=2,tp=2 "$tmp/mlp_pp2tp2" --micro-batch 2
run 4 pp=2,tsp=2 "$tmp/mlp_from_pp" --micro-batch 1 --stop-after 4
run 2 tp=2 "$tmp/mlp_from_pp" --resume
compare mlp_one mlp_tsp2 mlp_tp2 mlp_dp2tsp2 mlp_pp2tp2 mlp_from_pp
echo "train_variants: qwen3 with attention_bias and one KV head, and llama with attention_bias and mlp_bias, train alike"
echo "under dp and pp (f32 and bf16), and reshard"
