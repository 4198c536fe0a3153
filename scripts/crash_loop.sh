#!/usr/bin/env bash
# The spool's kill -9 loop, run long: ITERATIONS kills of a single relay and
# MESH_ITERATIONS of the sender's relay in a two-relay mesh (default 1600 and
# 400: 2,000 in all), plus each named crash point POINT_RUNS times (default 5).
# Prints the figures (kills, publishes accepted, lost, duplicated,
# acked-but-redelivered) and exits 1 on any violation. CI runs a short budget
# of it (ctest spool_crash_py: 70 + 30 kills, each point once).
# usage: scripts/crash_loop.sh [ITERATIONS] [MESH_ITERATIONS] [POINT_RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${KVRELAY_BUILD_DIR:-build}
export PYTHONDONTWRITEBYTECODE=1   # kvrelay: the package installed in .venv (scripts/install_python.sh)
# Copies of the binaries: a rebuild during the hour-long run does not pull
# them from under it.
BIN=$(mktemp -d /tmp/kvrelay-crash-bin-XXXXXX)
trap 'rm -rf "$BIN"' EXIT
cp "$BUILD_DIR/bin/kvrelay-server" "$BUILD_DIR/bin/kvrelayctl" "$BIN/"
.venv/bin/python tests/server/test_spool_crash.py --server "$BIN/kvrelay-server" \
  --kvrelayctl "$BIN/kvrelayctl" --iterations "${1:-1600}" --mesh-iterations "${2:-400}" \
  --point-runs "${3:-5}"
