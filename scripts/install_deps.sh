#!/usr/bin/env bash
# Installs every build and test dependency of kvrelay on a bare Debian 12 machine.
# Idempotent: skips apt-get when every package is already installed.
# usage: scripts/install_deps.sh [--build-only]
set -euo pipefail

# What building kvrelay (server, clients, tests, benchmarks) needs.
PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates curl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libeigen3-dev libspdlog-dev libfmt-dev prometheus-cpp-dev libhtscodecs-dev
  libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libssl-dev
)
# What running the test suite needs on top: Debian's Python with venv (the
# project's virtual environment .venv gets numpy, grpcio, torch, transformers
# and matplotlib from PyPI: scripts/install_python.sh), promtool and
# Prometheus, Node for its client, kustomize (below),
# clang and its sanitizer/libFuzzer runtimes for scripts/fuzz.sh (and clang for scripts/thread_safety.sh), libfiu
# (fiu-run, fiu-ctrl and its POSIX preload) for the spool's I/O-fault test.
# `--build-only` (scripts/run.sh, the Dockerfile) skips these.
if [[ "${1:-}" != "--build-only" ]]; then
  PACKAGES+=(
    python3 python3-venv
    prometheus
    iproute2 openssl
    clang libclang-rt-14-dev
    fiu-utils libfiu-dev
  )
  # Node.js/npm may come from other repositories on the image; take
  # Debian's only when the command is missing.
  command -v node >/dev/null 2>&1 || PACKAGES+=(nodejs)
  command -v npm >/dev/null 2>&1 || PACKAGES+=(npm)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "install_deps: installing ${missing[*]}"
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "install_deps: all packages present"
fi

if [[ "${1:-}" != "--build-only" ]]; then
  cd "$(dirname "$0")/.."
  bash scripts/install_python.sh
  # npm's cache for tests/client/node: the locked packages (npm ci) and what
  # `npm install` of the packed client resolves (its dependencies without the
  # dev ones), so the test installs from the cache.
  node_tmp=$(mktemp -d)
  cp client/node/package.json client/node/package-lock.json "$node_tmp"/
  (cd "$node_tmp" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error \
    && rm -rf node_modules package-lock.json && npm pkg delete devDependencies \
    && npm install --ignore-scripts --no-audit --no-fund --package-lock=false --loglevel=error)
  rm -rf "$node_tmp"
  # The Go client's module cache and its pinned protoc plugins. Go itself
  # (1.25 or newer; Debian 12's golang-go is 1.19) is the machine's: the
  # project's machines have Go 1.26 in /usr/local/go. The script says so and
  # fails when it is missing or older.
  bash scripts/install_go_tools.sh
  # kustomize v4 or newer builds deploy/kubernetes (`resources`, `patches`).
  # A kubectl on the image may embed one; otherwise (no kubectl, or Debian's
  # kubernetes-client 1.20 with kustomize v2.0) kustomize comes from the Go
  # module proxy into .tools/bin, which the deploy test then uses.
  KUSTOMIZE_VERSION=v5.7.1
  embedded=$(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\)\..*/\1/p' || true)
  if [[ -z "$embedded" || "$embedded" -lt 4 ]] &&
     [[ "$(.tools/bin/kustomize version 2>/dev/null)" != "$KUSTOMIZE_VERSION" ]]; then
    echo "install_deps: kustomize $KUSTOMIZE_VERSION from the Go module proxy into .tools/bin"
    GOTOOLCHAIN=local GOBIN="$PWD/.tools/bin" go install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION"
  fi
fi
