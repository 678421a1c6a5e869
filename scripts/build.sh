#!/usr/bin/env bash
# Configures and builds foldpar into build/ (Release, Ninja). Extra arguments go to cmake's
# configure step, e.g. ./scripts/build.sh -DFOLDPAR_SANITIZE=address,undefined.
# BUILD_DIR overrides the directory.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
. scripts/ccache-env.sh
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${ccache_flags[@]}" "$@" >/dev/null
cmake --build "$build_dir"
