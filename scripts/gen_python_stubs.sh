#!/usr/bin/env bash
# Writes the Python stubs of proto/kvrelay/v1/relay.proto (relay_pb2.py, its
# .pyi and relay_pb2_grpc.py) into OUT/kvrelay/v1 with the grpcio-tools of the
# project's virtual environment (version pinned in python/requirements.lock).
# usage: scripts/gen_python_stubs.sh [OUT]   (default: client/python, the committed copy)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${KVRELAY_VENV_PYTHON:-.venv/bin/python}
OUT=${1:-client/python}
if ! "$PY" -c "import grpc_tools" 2>/dev/null; then
  echo "gen_python_stubs: $PY has no grpc_tools; run scripts/install_python.sh" >&2
  exit 1
fi
mkdir -p "$OUT/kvrelay/v1"
"$PY" -m grpc_tools.protoc -I proto --python_out="$OUT" --pyi_out="$OUT" \
  --grpc_python_out="$OUT" proto/kvrelay/v1/relay.proto
