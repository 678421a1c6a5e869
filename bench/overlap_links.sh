#!/usr/bin/env bash
# Overlap on against off, per link class (issue 17, "overlap that pays or stays off"): TSP's
# step with its transfers posted ahead and progressed between computations (tsp=2) against
# the same step with every transfer waited where it is posted (tsp=2:nooverlap), timed side by
# side in one bench-layouts job (steps interleaved, medians), on
#   shm   two ranks on this host: OpenMPI's shared-memory transport (single-copy reads);
#   tcp   two "hosts" on this machine (network namespaces on a bridge, TCP only,
#         tests/e2e/multihost_lib.sh), one rank each, unshaped (the veth pair's rate);
#   RATE  the same, each host's link shaped by a token bucket (tc tbf), e.g. 10gbit 1gbit.
# Two ranks, one per core: the timing is honest here. Usage (root for the tcp classes):
#   bench/overlap_links.sh [config] [seqs] [steps] [classes...]
#   defaults: configs/small.json 1024,4096 5 shm tcp 10gbit 1gbit
# MPI_FLAGS (environment) goes to mpirun, e.g. MPI_FLAGS="--mca btl_tcp_progress_thread 1".
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/small.json}
seqs=${2:-1024,4096}
steps=${3:-5}
shift $(($# < 3 ? $# : 3))
classes=("$@")
[ ${#classes[@]} -gt 0 ] || classes=(shm tcp 10gbit 1gbit)
bin=$(pwd)/build/tools/foldpar
[ -x "$bin" ] || { echo "overlap_links: $bin is not built (./scripts/build.sh)" >&2; exit 2; }
export OPENBLAS_NUM_THREADS=1
args=(bench-layouts --model "$(pwd)/$config" --seq "$seqs" --batch 1 --steps "$steps" --warmup 1
  --layouts tsp=2 tsp=2:nooverlap)
source tests/e2e/multihost_lib.sh
up=0
trap '[ "$up" = 1 ] && mh_down' EXIT
for c in "${classes[@]}"; do
  echo "== link class: $c ($(date -u +%H:%M:%S))"
  if [ "$c" = shm ]; then
    mpirun --allow-run-as-root -np 2 --bind-to core ${MPI_FLAGS:-} "$bin" "${args[@]}"
    continue
  fi
  command -v tc >/dev/null || { echo "overlap_links: needs tc (iproute2)" >&2; exit 2; }
  if [ "$up" = 0 ]; then
    mh_up 2 1
    up=1
  fi
  for i in 0 1; do
    ip netns exec "$(mh_ns "$i")" tc qdisc del dev eth0 root 2>/dev/null || true
    [ "$c" = tcp ] || ip netns exec "$(mh_ns "$i")" tc qdisc add dev eth0 root tbf rate "$c" burst 256kb latency 100ms
  done
  mh_mpirun -np 2 ${MPI_FLAGS:-} "$bin" "${args[@]}"
done
