#!/usr/bin/env bash
# Bad mixture-of-experts configs, and MoE models where no strategy runs them yet: exit 2
# and one line on stderr naming the values.
set -u
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
base="$src/configs/tiny-moe.json"
# name | sed expression applied to tiny-moe.json | the message's words
cases=(
  "k above E|s/\"num_experts_per_tok\": 2/\"num_experts_per_tok\": 5/|num_experts_per_tok (5) must be in [1, num_experts (4)]"
  "k zero|s/\"num_experts_per_tok\": 2/\"num_experts_per_tok\": 0/|num_experts_per_tok (0) must be in [1, num_experts (4)]"
  "no experts|s/\"num_local_experts\": 4,//|a mixtral model needs a positive num_local_experts (got 0)"
  "unknown router|s/\"num_experts_per_tok\": 2,/\"num_experts_per_tok\": 2, \"scoring_func\": \"sigmoid\",/|router scoring_func \"sigmoid\" is not supported"
  "router noise|s/\"num_experts_per_tok\": 2,/\"num_experts_per_tok\": 2, \"router_jitter_noise\": 0.01,/|router_jitter_noise 0.01 is not supported"
  "negative capacity|s/\"num_experts_per_tok\": 2,/\"num_experts_per_tok\": 2, \"moe_capacity_factor\": -1,/|moe_capacity_factor (-1) must be in [0, 1e6] (0: dropless)"
  "negative aux coef|s/\"router_aux_loss_coef\": 0.02/\"router_aux_loss_coef\": -1/|router_aux_loss_coef (-1) must not be negative"
  "qwen2_moe|s/\"mixtral\"/\"qwen2_moe\"/|model_type \"qwen2_moe\" has q/k/v biases"
  "qwen3_moe|s/\"mixtral\"/\"qwen3_moe\"/|model_type \"qwen3_moe\" has per-head q/k RMSNorm"
)
for c in "${cases[@]}"; do
  IFS='|' read -r name expr words <<<"$c"
  sed "$expr" "$base" >"$tmp/bad.json"
  "$bin" verify --model "$tmp/bad.json" >/dev/null 2>"$tmp/err"
  rc=$?
  if [ "$rc" -ne 2 ] || [ "$(wc -l <"$tmp/err")" -ne 1 ] || ! grep -qF -- "$words" "$tmp/err"; then
    echo "FAIL $name: exit $rc, wanted 2 and one line containing '$words':" >&2
    cat "$tmp/err" >&2
    failures=$((failures + 1))
  fi
done
# A good MoE config on a layout no strategy runs experts on (zb), or with a knob of another
# strategy: refused by name.
refused() {  # LAYOUT WORDS
  "$mpirun" --allow-run-as-root -np 2 "$bin" verify --model "$base" --layout "$1" >/dev/null 2>"$tmp/err"
  local rc=$?
  if [ "$rc" -ne 2 ] || ! grep -qF -- "$2" "$tmp/err"; then
    echo "FAIL layout $1: exit $rc, wanted 2 and '$2':" >&2
    cat "$tmp/err" >&2
    failures=$((failures + 1))
  fi
}
refused pp=2,tp=1:zb "the zero-bubble schedule (zb) does not split a mixture-of-experts layer's backward"
refused pp=2,tsp=1:zb "the zero-bubble schedule (zb) does not split a mixture-of-experts layer's backward"
refused tp=2:moe=a2a "moe=a2a|gather|ring chooses the dispatch of a tsp=N layout"
refused dp=2,tsp=1 "verify runs every dp replica on the whole batch"
# Experts over dp replicas (ep=N): the layouts validate_layout refuses, one line naming the
# values, exit 2 (plan checks an explicit layout without ranks to start).
refused_plan() {  # DEVICES LAYOUT WORDS [MODEL]
  "$bin" plan --model "${4:-$base}" --seq 64 --batch 8 --devices "$1" --hardware "$src/hardware/mi300x-8.json" \
    --layouts "$2" >/dev/null 2>"$tmp/err"
  local rc=$?
  if [ "$rc" -ne 2 ] || [ "$(wc -l <"$tmp/err")" -ne 1 ] || ! grep -qF -- "$3" "$tmp/err"; then
    echo "FAIL plan layout $2: exit $rc, wanted 2 and one line containing '$3':" >&2
    cat "$tmp/err" >&2
    failures=$((failures + 1))
  fi
}
refused_plan 4 dp=2,tp=2,ep=3 "ep (3) must be a multiple of the model group's 2 ranks"
refused_plan 6 dp=3,tp=2,ep=4 "ep/2 (2 = 4 / 2) dp replicas per expert group must divide dp (3)"
refused_plan 8 dp=8,tsp=1,ep=8 "the 4 experts must divide over the ep=8 ranks"
refused_plan 8 pp=2,dp=2,tp=2,ep=8 "ep/2 (4 = 8 / 2) dp replicas per expert group must divide dp (2)"
# The capacity limit on a Megatron layout whose expert axis spans dp replicas (its exchange
# of each sequence's ids runs over that axis): refused by name.
sed 's/"num_experts_per_tok": 2,/"num_experts_per_tok": 2, "moe_capacity_factor": 0.5,/' "$base" >"$tmp/capacity.json"
refused_plan 4 dp=2,tp=2,ep=4 "moe_capacity_factor 0.5 (dropping pairs over an expert's capacity) with ep (4) beyond tp x sp (2) is not supported" \
  "$tmp/capacity.json"
refused_plan 4 dp=2,tp=2,ep=4 "ep=4 spreads the routed experts of a mixture-of-experts model; this model has none" \
  "$src/configs/tiny.json"
# Under pp each stage's expert groups span its own dp replicas: planned, no longer refused
# (the expert-weight ring over them too).
for layout in pp=2,dp=2,tp=2,ep=4 pp=2,dp=2,tsp=2,ep=4:moe=ring; do
  if ! "$bin" plan --model "$base" --seq 64 --batch 8 --devices 8 --hardware "$src/hardware/mi300x-8.json" \
      --layouts "$layout" >/dev/null 2>"$tmp/err"; then
    echo "FAIL plan layout $layout: refused:" >&2
    cat "$tmp/err" >&2
    failures=$((failures + 1))
  fi
done
[ "$failures" -eq 0 ] && echo "moe errors: PASS"
exit $((failures > 0))
