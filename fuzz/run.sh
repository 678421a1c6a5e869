#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, AddressSanitizer + UndefinedBehaviorSanitizer) into
# build-fuzz/ and runs each for a fixed budget, one at a time on one core, starting from the
# checked-in corpus tests/data/fuzz_corpus/<target>/ (plus tests/data/safetensors_corpus/).
# Prints one line per target: executions, crashes (any abort, sanitizer report, uncaught
# exception, > 10 s on one input or one allocation > 256 MiB), and where the artifacts are.
#
# Usage: fuzz/run.sh [seconds per target, default 120] [target...]
#   FUZZ_MERGE=N also adds up to N of the inputs that reached new coverage (libFuzzer's
#   merge: a minimal set covering every feature; <= 2 KiB each, picked by hash) to the
#   checked-in corpus, which tests/unit/fuzz_corpus_test.cc replays in the normal build.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-120}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors checkpoint_manifest llama_config token_file npy)

CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DFOLDPAR_SANITIZE=address,undefined -DFOLDPAR_BUILD_FUZZ=ON -DFOLDPAR_BUILD_TESTS=OFF \
  -DFOLDPAR_BUILD_BENCH=OFF >/dev/null
cmake --build build-fuzz --parallel 2 --target "${targets[@]/%/_fuzzer}"

work=build-fuzz/work
for t in "${targets[@]}"; do
  corpus=tests/data/fuzz_corpus/$t
  rm -rf "$work/$t" "$work/$t.artifacts"
  mkdir -p "$work/$t" "$work/$t.artifacts"
  cp "$corpus"/* "$work/$t/"
  [ "$t" = safetensors ] && cp tests/data/safetensors_corpus/* "$work/$t/"
  log=$work/$t.log
  # Fork mode with -ignore_crashes keeps fuzzing after a finding, so the count is complete.
  build-fuzz/fuzz/${t}_fuzzer -fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
    -max_total_time="$seconds" -timeout=10 -malloc_limit_mb=256 -max_len=16384 \
    -dict=fuzz/json.dict -artifact_prefix="$work/$t.artifacts/" "$work/$t" >"$log" 2>&1 || true
  stats=$(grep -E '^#[0-9]+: cov' "$log" | tail -1)
  execs=$(sed -E 's/^#([0-9]+):.*/\1/' <<<"$stats")
  crashes=$(ls "$work/$t.artifacts" | wc -l)
  echo "$t: ${execs:-?} executions in ${seconds} s, $crashes crashes (artifacts: $work/$t.artifacts/, log: $log)"
  if [ "${FUZZ_MERGE:-0}" -gt 0 ]; then
    rm -rf "$work/$t.min" && mkdir -p "$work/$t.min"
    build-fuzz/fuzz/${t}_fuzzer -merge=1 "$work/$t.min" "$work/$t" >"$work/$t.merge.log" 2>&1
    find "$work/$t.min" -type f -size -2049c -printf '%f\n' | sort | head -n "$FUZZ_MERGE" |
      while read -r f; do [ -e "$corpus/fuzzed-$f" ] || cp "$work/$t.min/$f" "$corpus/fuzzed-$f"; done
    echo "  checked-in corpus: $(ls "$corpus" | wc -l) files"
  fi
done
