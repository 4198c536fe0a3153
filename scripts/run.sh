#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs kvrelay.
#
# The relay server (kvrelay-server) is not built yet (issue 3). Until it is,
# this runs the offline compression engine end to end: it makes a synthetic
# Qwen3-14B-shaped agent turn, compresses it with the paper's policies, and
# inspects the result.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
BIN=${KVRELAY_BUILD_DIR:-build}/bin
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$BIN/kvrelayctl" make-turn --out "$work/turn.safetensors" --layers 40 --kv-heads 8 \
  --score-heads 40 --head-dim 128 --prompt 512 --gen 40 --dtype BF16 --seed 1
for policy in full gen h2o-layer:k=32 h2o-head:k=32 "h2o-head:k=32+obf:p=8" \
              "h2o-head:k=32+obf:p=8,mode=fast" "h2o-head:k=32+obf:p=8,mode=fast+int4:rotate=hadamard"; do
  "$BIN/kvrelayctl" compress --policy "$policy" --in "$work/turn.safetensors" --out "$work/msg.safetensors"
done
"$BIN/kvrelayctl" inspect "$work/msg.safetensors"
