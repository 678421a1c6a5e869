#!/usr/bin/env bash
# Which axis should cross the slow link (issue 18's benchmark, the paper's point): two "hosts"
# on this machine (network namespaces joined by a bridge, TCP only: tests/e2e/multihost_lib.sh),
# two ranks each, their links shaped to RATE by a token bucket (tc tbf). bench-layouts then
# times, side by side in one job, pp=2,tsp=2 (each TSP group inside a host, the pipeline
# boundary across) against tsp=4 (TSP's weight shards and K/V across the hosts), with the
# bytes each sent. Ranks fill host 0 first (by slot), so ranks 0-1 are stage 0 on fphost0.
# Four ranks share two cores: the figure is the step time on shaped links, where transfers
# dominate; compare the two layouts with each other, not with an unshaped run.
# Usage (root): bench/pipeline_hosts.sh [config] [seq] [batch] [rate] [steps]
#   defaults: configs/small.json 1024 4 1gbit 2
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/small.json}
seq=${2:-1024}
batch=${3:-4}
rate=${4:-1gbit}
steps=${5:-2}
bin=$(pwd)/build/tools/foldpar
[ -x "$bin" ] || { echo "pipeline_hosts: $bin is not built (./scripts/build.sh)" >&2; exit 2; }
command -v tc >/dev/null || { echo "pipeline_hosts: needs tc (iproute2)" >&2; exit 2; }
source tests/e2e/multihost_lib.sh
trap 'mh_down' EXIT
export OPENBLAS_NUM_THREADS=1
mh_up 2 2
for i in 0 1; do
  ip netns exec "$(mh_ns "$i")" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 100ms
done
placement=$(mh_mpirun -np 4 sh -c 'echo "$OMPI_COMM_WORLD_RANK $(hostname)"' | sort | tr '\n' ' ')
echo "placement: $placement; links shaped to $rate per direction (tbf)"
mh_mpirun -np 4 --oversubscribe "$bin" bench-layouts --model "$(pwd)/$config" --seq "$seq" --batch "$batch" \
  --steps "$steps" --layouts pp=2,tsp=2 tsp=4
echo "host 1 received $(mh_rx_bytes 1) bytes in all"
