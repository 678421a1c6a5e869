#!/usr/bin/env bash
# foldpar calibrate, end to end at 2 ranks: it writes a hardware description that loads
# (foldpar plan reads it), with every timeline field measured and in range, the collectives
# beside the ring model, the copy share from its two measured figures, the link size tables
# from their measured times; at 1 rank it exits 2
# naming the rank count. Checks what was written, never how fast this machine is.
set -u
mpirun=$1 bin=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
export OPENBLAS_NUM_THREADS=1

"$mpirun" --allow-run-as-root -np 2 "$bin" calibrate --out "$tmp/hw.json" >"$tmp/stdout" 2>"$tmp/stderr" ||
  fail "calibrate at 2 ranks exited $?: $(cat "$tmp/stderr")"
cmp -s "$tmp/stdout" "$tmp/hw.json" || fail "stdout and --out differ"
grep -q '^all_reduce_16777216B .*measured .* s, ring model .* s$' "$tmp/stderr" ||
  fail "no all_reduce line against the ring model: $(cat "$tmp/stderr")"
/usr/bin/python3 - "$tmp/hw.json" <<'PY' || fail "calibrate's JSON content"
import json, sys
h = json.load(open(sys.argv[1]))
assert h["devices_per_node"] == 2, h["devices_per_node"]
table = h["gemm_efficiency_by_min_dim"]
assert [m for m, _ in table] == [32, 64, 128, 256, 512, 1024], table
assert max(e for _, e in table) == 1.0 and all(0 < e <= 1 for _, e in table), table
for f in ["attention_fwd_efficiency", "attention_bwd_efficiency", "attention_efficiency", "matmul_efficiency"]:
    assert 0 < h[f] <= 1, (f, h[f])
for f in ["peak_tflops_f32", "memory_gb_per_s", "intra_node_gb_per_s", "intra_node_latency_s"]:
    assert h[f] > 0, (f, h[f])
assert h["intra_node_latency_s"] < 1e-2, h["intra_node_latency_s"]
assert set(h["collective_efficiency"]) == {"all_reduce", "all_gather", "reduce_scatter"}, h["collective_efficiency"]
# Every token-wise op of a training step has its own rate.
tw = h["tokenwise_gb_per_s_by_op"]
assert set(tw) == {"rmsnorm_forward", "rmsnorm_backward", "swiglu_forward", "swiglu_backward", "rope_forward",
                   "rope_backward", "add_inplace", "copy", "fill"}, sorted(tw)
assert all(r > 0 for r in tw.values()), tw
m = h["measured"]
for k in ["all_reduce", "all_gather", "reduce_scatter"]:
    assert m[k + "_16777216B_s"] > 0 and m[k + "_16777216B_ring_model_s"] > 0, k
# The copy share is the measured GEMMs' slowdown with a stream of 16 MiB ring steps in flight
# over the steps' own time, clamped to [0, 4] (absent from the file when 0); one node:
# inter = intra.
alone, both = m["copy_share_gemms_alone_s"], m["copy_share_gemms_with_send_recv_16MiB_s"]
count = m["copy_share_send_recv_16MiB_count"]
assert alone > 0 and both > 0 and count >= 1 and count == int(count), (alone, both, count)
share = h.get("intra_node_copy_share", 0.0)
want = min(4.0, max(0.0, (both - alone) / (count * m["send_recv_16MiB_s"])))
assert abs(share - want) < 1e-9, (share, want)
assert h.get("inter_node_copy_share", 0.0) == share, h.get("inter_node_copy_share")
# The size tables: six kinds, blocking and non-blocking ("i" + kind), at 1, 4, 16 and 64 MiB
# of full tensor; each rate the counted bytes (comm_stats.h, N = 2) over the median time less
# the latency steps; inter-node set equal.
tables = h["intra_node_gb_per_s_by_bytes"]
kinds = ["send_recv", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"]
assert set(tables) == set(kinds + ["i" + k for k in kinds]), sorted(tables)
assert h["inter_node_gb_per_s_by_bytes"] == tables
lat = h["intra_node_latency_s"]
for key, points in tables.items():
    kind = key[1:] if key[1:] in kinds else key
    share = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}.get(kind, 1.0)
    steps = 2 if kind == "all_reduce" else 1
    assert len(points) == 4, (key, points)
    for (counted, rate), mib in zip(points, [1, 4, 16, 64]):
        assert counted == share * mib * 2**20, (key, counted, mib)
        s = m["size_table_%s_%dMiB_s" % (key, mib)]
        assert rate > 0 and abs(rate - counted / max(s - steps * lat, 1e-9) / 1e9) <= 1e-9 * rate, (key, mib, rate, s)
PY
"$bin" plan --model "$src/configs/tiny.json" --seq 256 --devices 2 --hardware "$tmp/hw.json" >/dev/null ||
  fail "plan does not take calibrate's file (exit $?)"

err=$("$mpirun" --allow-run-as-root -np 1 "$bin" calibrate 2>&1 >/dev/null)
rc=$?
[ "$rc" -eq 2 ] || fail "calibrate at 1 rank exited $rc, want 2"
grep -q "got 1 rank" <<<"$err" || fail "the 1-rank error does not name the count: $err"

[ "$failures" -eq 0 ] && echo "calibrate: all checks passed"
exit "$failures"
