#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU (made for an H200; 16 cores): builds the
# CUDA targets (build-gpu/), runs the GPU tests (ctest -L gpu: every CUDA op against the
# CPU reference, flash attention, a model step, TSP at D = 1 and 2 on one GPU, the device
# communicators), then gpu_bench, and prints a short table last. Budget: under 8 minutes
# (each phase has its own timeout: build 240 s, tests 120 s, benchmark 110 s).
# Exit status: 0 when every test passed, 1 otherwise, 2 when something needed is missing.
# Usage: ./scripts/gpu-check.sh [--quick]   (--quick: smaller benchmark sizes)
set -uo pipefail
cd "$(dirname "$0")/.."
quick=()
[ "${1:-}" = "--quick" ] && quick=(--quick)
build_dir=${BUILD_DIR:-build-gpu}
log_dir=${LOG_DIR:-$build_dir/gpu-check}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }

# ---- what this machine has ----
missing=()
export PATH="$PATH:/usr/local/cuda/bin"
command -v nvcc >/dev/null 2>&1 || missing+=("nvcc (CUDA toolkit; expected under /usr/local/cuda/bin)")
command -v nvidia-smi >/dev/null 2>&1 || missing+=("nvidia-smi (NVIDIA driver)")
for tool in cmake ninja g++ mpirun pkg-config; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
# The Debian packages scripts/setup.sh lists for building (this machine may not reach a mirror).
for pkg in libopenblas-dev libopenmpi-dev libcli11-dev nlohmann-json3-dev libfmt-dev libgtest-dev \
           libgmock-dev; do
  if command -v dpkg-query >/dev/null 2>&1 &&
     ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("Debian package $pkg")
  fi
done
for lib in libcublas.so libnccl.so; do
  ls /usr/local/cuda/lib64/$lib >/dev/null 2>&1 || ldconfig -p 2>/dev/null | grep -q "$lib" ||
    missing+=("$lib (CUDA toolkit / NCCL)")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu-check: cannot run; missing:" >&2
  printf '  - %s\n' "${missing[@]}" >&2
  echo "gpu-check: install them (scripts/setup.sh lists the Debian packages) and run again" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mkdir -p "$log_dir"

# ---- build (about 2 minutes on 16 cores) ----
echo "gpu-check: building into $build_dir"
if ! timeout 240 env BUILD_DIR="$build_dir" ./scripts/build-cuda.sh >"$log_dir/build.log" 2>&1; then
  tail -40 "$log_dir/build.log"
  echo "gpu-check: build failed after $(elapsed) s (log: $log_dir/build.log)" >&2
  exit 1
fi
echo "gpu-check: built in $(elapsed) s"

# ---- tests ----
tests_ok=1
if ! timeout 120 ctest --test-dir "$build_dir" -L gpu --output-on-failure --timeout 100 >"$log_dir/tests.log" 2>&1; then
  tests_ok=0
fi
grep -E "tests passed|tests failed|\*\*\*|Failed|SKIPPED" "$log_dir/tests.log" | tail -20
passed=$(grep -Eo '[0-9]+% tests passed, [0-9]+ tests failed out of [0-9]+' "$log_dir/tests.log" | tail -1)
echo "gpu-check: tests done at $(elapsed) s"

# ---- benchmark ----
timeout 110 "$build_dir/bench/gpu_bench" "${quick[@]}" --configs configs >"$log_dir/bench.log" 2>&1
bench_rc=$?
grep -v '^RESULT' "$log_dir/bench.log"
get() { awk -v k="$1" '$1 == "RESULT" && $2 == k { print $3 }' "$log_dir/bench.log"; }

# ---- the table, last ----
echo
echo "gpu-check on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(elapsed) s in all"
printf '%-42s %12s   %s\n' "figure" "measured" "target (H200)"
printf '%-42s %12s   %s\n' "GPU tests (ctest -L gpu)" "${passed:-see log}" "all pass"
printf '%-42s %12s   %s\n' "bf16 GEMM 8192^3, TFLOP/s" "$(get gemm_bf16_tflops)" ">= 600"
printf '%-42s %12s   %s\n' "attention fwd S=8192 d=128 (auto), TFLOP/s" "$(get attention_fwd_tflops)" ">= 350"
printf '%-42s %12s   %s\n' "attention bwd S=8192 d=128 (auto), TFLOP/s" "$(get attention_bwd_tflops)" ">= 250"
printf '%-42s %12s   %s\n' "  simple kernel fwd, TFLOP/s" "$(get attention_fwd_simple_tflops)" "- (reference)"
printf '%-42s %12s   %s\n' "  simple kernel bwd, TFLOP/s" "$(get attention_bwd_simple_tflops)" "- (reference)"
printf '%-42s %12s   %s\n' "train step small.json, tokens/s" "$(get small_tokens_per_s)" "-"
printf '%-42s %12s   %s\n' "train step small.json, MFU %" "$(get small_mfu_percent)" "-"
printf '%-42s %12s   %s\n' "train step llama-1b.json, tokens/s" "$(get llama_1b_tokens_per_s)" "-"
printf '%-42s %12s   %s\n' "train step llama-1b.json, MFU %" "$(get llama_1b_mfu_percent)" ">= 40"
[ "$bench_rc" = 0 ] || echo "gpu-check: gpu_bench exited $bench_rc (log: $log_dir/bench.log)"
[ "$tests_ok" = 1 ] || { echo "gpu-check: GPU tests failed (log: $log_dir/tests.log)"; exit 1; }
