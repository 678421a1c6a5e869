#!/usr/bin/env bash
# foldpar's single-rank training step against plain PyTorch (bench/torch_peer.py) on the same
# config, one thread each, in one run: for each S the two alternate, each in a fresh process
# (so each peak RSS belongs to one S), `rounds` times; the table gives medians.
# Usage: bench/step_vs_torch.sh [config] [seqs] [rounds] [recompute]
#        (defaults: configs/small.json 1024,4096 2 none; recompute none|block is foldpar's)
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/small.json}
seqs=${2:-1024,4096}
rounds=${3:-2}
recompute=${4:-none}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for s in ${seqs//,/ }; do
  for r in $(seq "$rounds"); do
    build/bench/train_step_bench --model "$config" --seq "$s" --steps 3 --recompute "$recompute" --json \
      >>"$out/foldpar.$s"
    /usr/bin/python3 bench/torch_peer.py --config "$config" --seq "$s" --steps 3 --warmup 1 --threads 1 --json \
      2>/dev/null >>"$out/torch.$s"
  done
done
/usr/bin/python3 - "$out" "$seqs" <<'PY'
import json, statistics, sys
out, seqs = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
def load(name):
    return [json.loads(l) for l in open(f"{out}/{name}") if l.strip().startswith("{")]
print(f"{'S':>6} {'foldpar tok/s':>14} {'torch tok/s':>12} {'speedup':>8} {'foldpar GF/s':>13} {'of sgemm':>9} "
      f"{'foldpar RSS MiB':>16} {'torch RSS MiB':>14} {'memory ratio':>13}")
for s in seqs:
    f, t = load(f"foldpar.{s}"), load(f"torch.{s}")
    ftps = statistics.median(x["tokens_per_s"] for x in f)
    ttps = statistics.median(x["tokens_per_s"] for x in t)
    fgf = statistics.median(x["gflops"] for x in f)
    frac = statistics.median(x["fraction_of_sgemm"] for x in f)
    frss = statistics.median(x["peak_rss_bytes"] for x in f) / 2**20
    trss = statistics.median(x["peak_rss_bytes"] for x in t) / 2**20
    print(f"{s:>6} {ftps:>14.1f} {ttps:>12.1f} {ftps/ttps:>7.2f}x {fgf:>13.1f} {100*frac:>8.0f}% "
          f"{frss:>16.1f} {trss:>14.1f} {trss/frss:>12.1f}x")
PY
