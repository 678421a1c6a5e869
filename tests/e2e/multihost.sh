#!/usr/bin/env bash
# Training across hosts (multihost_lib.sh: network namespaces, TCP only): tsp=2 with one rank
# on each of two hosts, and dp=2,tsp=2 with two ranks per host placed so that both tsp groups
# span the hosts. The losses equal a single-host run's bit for bit, every rank ran on its own
# host, and at least what rank 0 counted as sent went over host 1's link.
set -euo pipefail
mpirun=$1 bin=$2 src=$3
here=$(cd "$(dirname "$0")" && pwd)
source "$here/faults_lib.sh"
source "$here/multihost_lib.sh"
tmp=$(mktemp -d)
trap 'mh_down; rm -rf "$tmp"' EXIT
"$bin" prepare-data --out "$tmp/data" >/dev/null
args=(train --model "$src/configs/tiny.json" --data "$tmp/data" --steps 8 --seq 64 --batch 4 --eval-every 0
      --eval-batches 1 --progress none --seed 3 --checkpoint-every 4)
single() {  # single NP LAYOUT OUT: the same training on this host alone
  "$mpirun" --allow-run-as-root --oversubscribe -np "$1" "$bin" "${args[@]}" --layout "$2" --out "$3" >/dev/null
}

mh_up 2 2  # two hosts, two slots each
# --map-by node deals ranks round-robin over the hosts: 0 -> fphost0, 1 -> fphost1, 2 -> fphost0, ...
hosts=$(mh_mpirun -np 4 --map-by node sh -c 'echo "$OMPI_COMM_WORLD_RANK $(hostname)"' | sort | tr '\n' ';')
[ "$hosts" = "0 fphost0;1 fphost1;2 fphost0;3 fphost1;" ] || die "ranks on the wrong hosts: $hosts"

rx_before=$(mh_rx_bytes 1)
mh_mpirun -np 2 --map-by node "$bin" "${args[@]}" --layout tsp=2 --out "$tmp/multi2" >/dev/null
rx_after=$(mh_rx_bytes 1)
single 2 tsp=2 "$tmp/single2"
same_losses "$tmp/multi2" "$tmp/single2" 1 8
/usr/bin/python3 - "$tmp/multi2/metrics.jsonl" "$((rx_after - rx_before))" <<'PY'
import json, sys
sent = sum(json.loads(l)["ranks"][0]["bytes_sent"] for l in open(sys.argv[1]))
received = int(sys.argv[2])
assert sent > 0 and received >= sent, f"host 1 received {received} bytes, rank 0 counted {sent} sent"
print(f"tsp=2 over two hosts: rank 0 sent {sent} bytes, host 1's link carried {received}")
PY
test -f "$tmp/multi2/checkpoints/step-00000008/manifest.json"

mh_mpirun -np 4 --map-by node "$bin" "${args[@]}" --layout dp=2,tsp=2 --out "$tmp/multi4" >/dev/null
single 4 dp=2,tsp=2 "$tmp/single4"
same_losses "$tmp/multi4" "$tmp/single4" 1 8
echo "dp=2,tsp=2 over two hosts (tsp spanning them) agrees with one host"
