#!/usr/bin/env bash
# The GPU check, for the GPU machine (one H200, 16 cores, CUDA 13 toolkit, cuBLAS, NCCL from
# Python's wheel, CMake, ninja; no Debian dev packages, nothing installable). Run from the
# repository root, after scripts/gpu-bundle.sh made gpu-bundle/ on a machine with the
# Debian registry and the folder travelled with the tree:
#     scripts/gpu-check.sh [--quick] [--no-gpu]   (--quick: smaller benchmark sizes)
# Steps, each with its own limit, all inside a budget of 470 s (under 8 minutes; a step that
# would pass the budget is cut to what is left and reported TIMEOUT):
#   probe      10 s   driver (nvidia-smi), a visible device, nvcc, NCCL, the bundle, tools
#   bundle     30 s   gpu-bundle/prefix.tar.xz unpacked into gpu-bundle/prefix (first run only)
#   configure  60 s   build-gpu/: CUDA on, against the bundle + the machine's CUDA/cuBLAS/NCCL
#   build     200 s   ninja -j16, only the targets the checks run (35-51 s on the H200 machine,
#                     2026-12-04; GPU_CHECK_BUILD_LIMIT overrides the limit)
#   tests      90 s   ctest -L gpu|cuda without gpu.device_e2e, 45 s per test
#   e2e       110 s   gpu.device_e2e (train/bench/generate --device cuda vs the CPU), 100 s
#   bench     240 s   gpu_bench (training steps through run_training; 90 s did not reach llama-1b)
# FOLDPAR_REQUIRE_GPU=1 is exported: a GPU test that would skip FAILS here (a skip on the GPU
# machine means CUDA could not start, not that the test passed).
# The summary (every step: status, seconds; every test: status; the benchmark figures; the
# last lines of the failed step's log) is printed by an EXIT trap, so it appears whatever
# step fails or is cut. Logs: build-gpu/gpu-check/<step>.log.
# Exit status: 0 every step passed; 1 a step failed or timed out; 2 the probe failed.
# Environment: BUILD_DIR (build-gpu), JOBS (16), FOLDPAR_NCCL_ROOT (where NCCL is),
# GPU_CHECK_BUDGET (470 s). --no-gpu: for trying the script where there is no GPU (the probe
# lets a missing driver pass, FOLDPAR_REQUIRE_GPU is not set, the GPU tests skip).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
quick=() no_gpu=0
for a in "$@"; do
  case $a in
    --quick) quick=(--quick) ;;
    --no-gpu) no_gpu=1 ;;
    *) echo "gpu-check: unknown argument '$a' (choices: --quick, --no-gpu)" >&2; exit 2 ;;
  esac
done
build_dir=${BUILD_DIR:-build-gpu}
log_dir=$build_dir/gpu-check
jobs=${JOBS:-16}
budget=${GPU_CHECK_BUDGET:-470}
mkdir -p "$log_dir"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
# On the H200 machine PMIx also tries a plugin in /usr/lib/x86_64-linux-gnu/pmix2 of another
# PMIx version (its zlib compression), fails to load it, and warns at every start. Harmless:
# silenced.
export PMIX_MCA_pcompress_base_silence_warning=1
[ "$no_gpu" = 1 ] || export FOLDPAR_REQUIRE_GPU=1
export PATH="$PATH:/usr/local/cuda/bin"
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }

step_names=() step_status=() step_secs=() step_notes=()
failed_step="" current_step="" exit_code=0

summary() {
  local rc=$?
  [ -n "$current_step" ] && { step_names+=("$current_step"); step_status+=("INTERRUPTED"); step_secs+=("-"); step_notes+=("exit $rc");
                              failed_step=${failed_step:-$current_step}; }
  echo
  echo "==== gpu-check summary ($(elapsed) s in all, budget $budget s) on $(hostname) ===="
  printf '%-10s %-12s %6s   %s\n' step status secs note
  local i
  for i in "${!step_names[@]}"; do
    printf '%-10s %-12s %6s   %s\n' "${step_names[$i]}" "${step_status[$i]}" "${step_secs[$i]}" "${step_notes[$i]}"
  done
  for f in tests e2e; do
    [ -f "$log_dir/$f.log" ] || continue
    echo "-- ctest ($f): --"
    grep -E '^ *[0-9]+/[0-9]+ Test +#' "$log_dir/$f.log" | sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: //; s/ \.+/ /' |
      awk '{printf "  %-36s %s %s %s %s\n", $1, $2, $3, $4, $5}'
    grep -E 'tests passed|tests failed' "$log_dir/$f.log" | tail -1 | sed 's/^/  /'
  done
  if [ -f "$log_dir/bench.log" ]; then
    get() { awk -v k="$1" '$1 == "RESULT" && $2 == k { print $3 }' "$log_dir/bench.log"; }
    echo "-- figures (gpu_bench) --"
    printf '  %-42s %12s   %s\n' "figure" "measured" "target (H200)"
    printf '  %-42s %12s   %s\n' "bf16 GEMM 8192^3, TFLOP/s" "$(get gemm_bf16_tflops)" ">= 600"
    printf '  %-42s %12s   %s\n' "attention fwd S=8192 d=128 (auto), TFLOP/s" "$(get attention_fwd_tflops)" ">= 350"
    printf '  %-42s %12s   %s\n' "attention bwd S=8192 d=128 (auto), TFLOP/s" "$(get attention_bwd_tflops)" ">= 250"
    printf '  %-42s %12s   %s\n' "attention fwd S=8192 d=64 (auto), TFLOP/s" "$(get attention_fwd_d64_tflops)" "-"
    printf '  %-42s %12s   %s\n' "attention bwd S=8192 d=64 (auto), TFLOP/s" "$(get attention_bwd_d64_tflops)" "-"
    printf '  %-42s %12s   %s\n' "  simple kernel fwd, TFLOP/s" "$(get attention_fwd_simple_tflops)" "- (reference)"
    printf '  %-42s %12s   %s\n' "  simple kernel bwd, TFLOP/s" "$(get attention_bwd_simple_tflops)" "- (reference)"
    printf '  %-42s %12s   %s\n' "train step small.json, tokens/s" "$(get small_tokens_per_s)" "-"
    printf '  %-42s %12s   %s\n' "train step small.json, MFU %" "$(get small_mfu_percent)" "-"
    printf '  %-42s %12s   %s\n' "train step llama-1b.json, tokens/s" "$(get llama_1b_tokens_per_s)" "-"
    printf '  %-42s %12s   %s\n' "train step llama-1b.json, MFU %" "$(get llama_1b_mfu_percent)" ">= 40"
  fi
  if [ -n "$failed_step" ]; then
    echo "-- first failed step: $failed_step; last lines of $log_dir/$failed_step.log --"
    tail -25 "$log_dir/$failed_step.log" 2>/dev/null | sed 's/^/  | /'
    echo "gpu-check: FAILED at step '$failed_step' (exit ${exit_code:-1})"
  else
    echo "gpu-check: every step passed"
  fi
}
trap summary EXIT
trap 'exit 130' INT TERM

# step NAME LIMIT CMD...: runs CMD with its output in $log_dir/NAME.log, under
# min(LIMIT, what is left of the budget); records PASS / FAIL (exit N) / TIMEOUT.
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( budget - $(elapsed) ))
  [ "$left" -lt "$limit" ] && limit=$left
  local note=""
  current_step=$name
  local s0; s0=$(date +%s)
  echo "gpu-check: [$name] up to ${limit} s ..."
  local rc
  if [ "$limit" -le 0 ]; then rc=124; echo "no time left in the budget" >"$log_dir/$name.log"
  elif declare -F "$1" >/dev/null; then  # a function of this script: in a child bash
    export -f "$1"
    timeout --kill-after=5 "$limit" bash -c '"$@"' _ "$@" >"$log_dir/$name.log" 2>&1; rc=$?
  else timeout --kill-after=5 "$limit" "$@" >"$log_dir/$name.log" 2>&1; rc=$?; fi
  local secs=$(( $(date +%s) - s0 )) status=PASS
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=TIMEOUT; note="cut at ${limit} s"
  elif [ "$rc" != 0 ]; then status=FAIL; note="exit $rc"; fi
  current_step=""
  step_names+=("$name"); step_status+=("$status"); step_secs+=("$secs"); step_notes+=("$note${STEP_NOTE:+ $STEP_NOTE}")
  STEP_NOTE=""
  echo "gpu-check: [$name] $status in $secs s"
  if [ "$status" != PASS ]; then failed_step=${failed_step:-$name}; exit_code=1; return 1; fi
}

# ---- probe: 10 s, every line printed ----
probe() {
  local ok=0 py l
  say() { printf '  %-8s %s\n' "$1" "$2"; }
  if command -v nvidia-smi >/dev/null 2>&1; then
    local q; q=$(timeout 5 nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1)
    if [ $? = 0 ] && [ -n "$q" ]; then say driver "ok: $(echo "$q" | head -1)"; say device "$(echo "$q" | wc -l) visible${CUDA_VISIBLE_DEVICES:+ (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)}"
    else say driver "FAIL: nvidia-smi: $(echo "$q" | head -1)"; say device "FAIL: none visible"; ok=1; fi
  else say driver "FAIL: nvidia-smi not found (no NVIDIA driver)"; say device "FAIL: none visible"; ok=1; fi
  if [ "$ok" = 1 ] && [ "$NO_GPU" = 1 ]; then say driver "(--no-gpu: going on without a GPU; the GPU tests will skip)"; ok=0; fi
  if command -v nvcc >/dev/null 2>&1; then say nvcc "ok: $(nvcc --version | grep -o 'release [0-9.]*' | head -1) ($(command -v nvcc))"
  else say nvcc "FAIL: not on PATH nor /usr/local/cuda/bin"; ok=1; fi
  local nccl="" d
  local dirs=(${FOLDPAR_NCCL_ROOT:-} ${NCCL_ROOT:-} /usr/local/cuda /usr/local/cuda/targets/x86_64-linux)
  for py in $(command -v -a python3 2>/dev/null | awk '!seen[$0]++'); do
    for d in $(timeout 3 "$py" -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null); do
      dirs+=("$d/nvidia/nccl")
    done
  done
  # CUDA 13's wheels may install under nvidia/cu13 rather than nvidia/nccl; failing the
  # named places, any libnccl.so.2 under /usr or /opt with include/nccl.h beside its lib/.
  for d in "${dirs[@]}"; do [ "${d%/nvidia/nccl}" != "$d" ] && dirs+=("${d%/nccl}/cu13"); done
  for l in $(timeout 5 find /usr /opt -name libnccl.so.2 2>/dev/null | head -5); do
    dirs+=("$(dirname "$(dirname "$l")")")
  done
  for d in "${dirs[@]}"; do
    for l in "$d"/lib/libnccl.so.2 "$d"/lib64/libnccl.so.2; do
      if [ -e "$l" ] && [ -f "$d/include/nccl.h" ]; then nccl=$d; break 2; fi
    done
  done
  if [ -n "$nccl" ]; then say nccl "ok: $nccl (libnccl.so.2, include/nccl.h)"; export FOLDPAR_NCCL_ROOT=$nccl
  else say nccl "FAIL: no libnccl.so.2 with include/nccl.h in ${dirs[*]} (set FOLDPAR_NCCL_ROOT)"; ok=1; fi
  for tool in cmake ninja g++ xz tar; do
    command -v "$tool" >/dev/null 2>&1 || { say tools "FAIL: $tool not found"; ok=1; }
  done
  # OpenMP (oneDNN's, and -fopenmp) is the compiler's own libgomp, not bundled.
  local gomp; gomp=$(g++ -print-file-name=libgomp.so 2>/dev/null)
  if [ "$gomp" = libgomp.so ] || [ ! -e "$gomp" ]; then say tools "FAIL: g++ has no libgomp.so (OpenMP; Debian: libgcc-<N>-dev)"; ok=1; fi
  local cmv; cmv=$(cmake --version 2>/dev/null | head -1 | awk '{print $3}')
  if [ -n "$cmv" ] && [ "$(printf '3.25\n%s\n' "$cmv" | sort -V | head -1)" != 3.25 ]; then
    say tools "FAIL: cmake $cmv is older than 3.25 (CMakeLists.txt's minimum)"; ok=1
  fi
  say tools "cmake $(cmake --version 2>/dev/null | head -1 | awk '{print $3}'), ninja $(ninja --version 2>/dev/null), g++ $(g++ -dumpversion 2>/dev/null), glibc $(ldd --version 2>/dev/null | head -1 | awk '{print $NF}')"
  if [ -f gpu-bundle/prefix.tar.xz ]; then
    say bundle "ok: gpu-bundle/prefix.tar.xz $(du -h gpu-bundle/prefix.tar.xz | cut -f1), $(sed -n 1p gpu-bundle/MANIFEST.txt 2>/dev/null | sed 's/^# gpu-bundle: //')"
    local need; need=$(sed -n 's/.*glibc >= \([0-9.]*\).*/\1/p' gpu-bundle/MANIFEST.txt 2>/dev/null)
    local have; have=$(ldd --version 2>/dev/null | head -1 | awk '{print $NF}')
    if [ -n "$need" ] && [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
      say bundle "FAIL: the bundle's libraries need glibc >= $need, this machine has $have"; ok=1
    fi
    local cxx; cxx=$(sed -n 's/.*libstdc++ >= \(GLIBCXX_[0-9.]*\).*/\1/p' gpu-bundle/MANIFEST.txt 2>/dev/null)
    local so; so=$(g++ -print-file-name=libstdc++.so.6 2>/dev/null)
    if [ -n "$cxx" ] && [ -f "$so" ] && ! grep -qaF "$cxx" "$so"; then
      say bundle "FAIL: the bundle's libraries need $cxx, which $so (g++ $(g++ -dumpversion)) lacks"; ok=1
    fi
  else say bundle "FAIL: gpu-bundle/prefix.tar.xz missing: run scripts/gpu-bundle.sh where the Debian registry is reachable, and bring gpu-bundle/ along"; ok=1; fi
  return $ok
}
export NO_GPU=$no_gpu
if ! step probe 10 probe; then
  exit_code=2
  exit 2
fi
cat "$log_dir/probe.log"
export FOLDPAR_NCCL_ROOT=$(sed -n 's/^  nccl     ok: \([^ ]*\) .*/\1/p' "$log_dir/probe.log")

# ---- the bundle, unpacked once ----
. scripts/gpu-bundle-env.sh
unpack() { . scripts/gpu-bundle-env.sh && bundle_setup "$(pwd)"; }
step bundle 30 unpack || exit 1
bundle_setup "$repo" || exit 1   # (already unpacked: sets PATH, LD_LIBRARY_PATH, OPAL_PREFIX here)

# ---- configure and build ----
targets=(staging_test device_watchdog_test cuda_memory_test cuda_ops_test cuda_attention_test cuda_model_test gpu_tsp_test gpu_comm_test
         gpu_bench foldpar)
step configure 60 cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFOLDPAR_WITH_CUDA=ON \
  -DFOLDPAR_BUILD_BENCH=ON -DFOLDPAR_NCCL_ROOT="$FOLDPAR_NCCL_ROOT" "${bundle_cmake_args[@]}" \
  -DFOLDPAR_GPU_TEST_TIMEOUT=45 -DFOLDPAR_GPU_E2E_TIMEOUT=100 || exit 1
step build "${GPU_CHECK_BUILD_LIMIT:-200}" ninja -C "$build_dir" -j"$jobs" "${targets[@]}" || exit 1

# ---- tests: the GPU tests (and the CUDA build's host tests), then the end-to-end test ----
step tests 90 ctest --test-dir "$build_dir" -L '^(gpu|cuda)$' -LE gpu_e2e --output-on-failure
step e2e 110 ctest --test-dir "$build_dir" -L gpu_e2e --output-on-failure

# ---- benchmark ----
step bench 240 "$build_dir/bench/gpu_bench" "${quick[@]}" --configs configs
exit "$exit_code"
