#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs the relay in the
# foreground with its embedded default, an in-memory store (no other server
# needed). Extra arguments go to kvrelay-server, e.g. --listen 127.0.0.1:0.
#
# Defaults: gRPC on 127.0.0.1:50051 (loopback only; --listen replaces it and
# is repeatable: e.g. --listen 0.0.0.0:50051 for other hosts, --listen
# unix:PATH for a Unix socket), Prometheus metrics on 0.0.0.0:9464/metrics.
# Stop it with Ctrl-C (SIGINT) or SIGTERM: it drains in-flight calls first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh --build-only
bash scripts/build.sh
exec "${KVRELAY_BUILD_DIR:-build}/bin/kvrelay-server" "$@"
