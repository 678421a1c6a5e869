#!/usr/bin/env bash
# The main job: sets up and builds, prepares the default corpus (Debian's fortunes, bytes),
# trains configs/small.json with TSP on two ranks (one per core) for a few minutes with a
# progress bar, prints the final validation loss, draws the curves, generates a sample from the
# trained model (TSP prefill, stationary-weight decode), and prints what each
# layout holds per rank for the same model (tracked memory peaks, counted traffic).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build.sh
export OPENBLAS_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
bin=./build/tools/foldpar
out=${FOLDPAR_DEMO_OUT:-out/demo}
steps=${FOLDPAR_DEMO_STEPS:-120}
rm -rf "$out"
mkdir -p "$out"

echo "== foldpar prepare-data (default corpus: Debian's fortunes, byte tokens)"
"$bin" prepare-data --out "$out/data"
echo
echo "== mpirun -np 2 foldpar train --model configs/small.json --layout tsp=2 ($steps steps)"
mpirun -np 2 "$bin" train --model configs/small.json --layout tsp=2 --data "$out/data" --out "$out/train" \
  --steps "$steps" --seq 256 --batch 8 --lr 1e-3 --warmup 20 --eval-every 50 --eval-batches 4 --print-every 10
"$bin" plot "$out/train/metrics.jsonl" -o "$out/plots" >/dev/null && echo "curves: $out/plots/{loss,throughput,memory}.png"
echo
echo "== mpirun -np 2 foldpar generate --checkpoint $out/train --layout tsp=2 (a sample, temperature 0.8)"
mpirun -np 2 "$bin" generate --checkpoint "$out/train" --layout tsp=2 --prompt "Q: What is the meaning of life?
A:" \
  --max-new-tokens 120 --temperature 0.8 --top-k 40 --seed 1
echo
echo "== memory and traffic per rank of each layout (configs/small.json, one training step, S = 2048)"
printf '%-10s %14s %14s %14s\n' layout "peak MiB/rank" "sent MiB/rank" "1-rank MiB"
for layout in tsp=2 tp=2 sp=2; do
  mpirun -np 2 "$bin" verify --model configs/small.json --layout "$layout" --batch 1 --seq 2048 --json >"$out/$layout.json"
  /usr/bin/python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))
mib = 1 << 20
print(f\"{r['layout']:<10} {max(r['peak_bytes'])/mib:>14.1f} {max(r['bytes_sent'])/mib:>14.1f} {r['single_rank_peak_bytes']/mib:>14.1f}\")
" "$out/$layout.json"
done
