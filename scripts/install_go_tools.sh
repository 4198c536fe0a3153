#!/usr/bin/env bash
# Installs what building and testing the Go client (client/go) needs from the
# Go module proxy, so that the test then builds offline (GOPROXY=off):
#   - protoc-gen-go and protoc-gen-go-grpc at the versions below, into
#     $(go env GOBIN), else $(go env GOPATH)/bin;
#   - client/go's dependencies, pinned by its go.mod and go.sum, into the
#     module cache (go mod download).
# Uses the `go` on PATH (or $GO), at least the version of client/go/go.mod's
# go line; never downloads a toolchain (GOTOOLCHAIN=local).
# usage: scripts/install_go_tools.sh
#
# Sourced (client/go/generate.sh does), it only sets the version variables.

# The versions the committed stubs (client/go/kvrelay/v1/*.pb.go) are made
# with. client/go/generate.sh refuses other versions, and the Go client test
# checks that the committed stubs are exactly what these make. Keep
# PROTOC_GEN_GO_VERSION equal to google.golang.org/protobuf in client/go/go.mod.
# After changing one: run this script, then client/go/generate.sh, and commit
# the stubs with it.
PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2

install_go_tools_main() {
  set -euo pipefail
  local root go have want
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  go=${GO:-go}
  export GOTOOLCHAIN=local
  if ! command -v "$go" >/dev/null 2>&1; then
    echo "install_go_tools: $go: not found, expected Go (https://go.dev/dl/) on PATH or in \$GO" >&2
    return 1
  fi
  have=$("$go" env GOVERSION)
  have=${have#go}
  want=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$root/client/go/go.mod")
  if [[ "$(printf '%s\n%s\n' "$want" "$have" | sort -V | head -n1)" != "$want" ]]; then
    echo "install_go_tools: $(command -v "$go") is go $have, expected >= $want (client/go/go.mod)" >&2
    return 1
  fi
  echo "install_go_tools: go $have; protoc-gen-go $PROTOC_GEN_GO_VERSION," \
    "protoc-gen-go-grpc $PROTOC_GEN_GO_GRPC_VERSION"
  "$go" install "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO_VERSION"
  "$go" install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC_VERSION"
  (cd "$root/client/go" && "$go" mod download)
  local bin
  bin=$("$go" env GOBIN)
  [[ -n "$bin" ]] || { bin=$("$go" env GOPATH); bin=${bin%%:*}/bin; }
  echo "install_go_tools: plugins in $bin; modules in $("$go" env GOMODCACHE)"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  install_go_tools_main "$@"
fi
