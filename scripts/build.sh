#!/usr/bin/env bash
# Configures and builds kvrelay into build/ (binaries in build/bin/).
# Usage: scripts/build.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${KVRELAY_BUILD_DIR:-build}
JOBS=${KVRELAY_JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD_DIR" -j "$JOBS"
