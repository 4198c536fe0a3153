#!/usr/bin/env bash
# Generates the Go stubs of proto/kvrelay/v1/relay.proto, kvrelay/v1/relay.pb.go
# and kvrelay/v1/relay_grpc.pb.go (package kvrelayv1), under OUT_DIR (default:
# this module's folder, i.e. in place; `go generate ./...` runs it so).
# The plugins are protoc-gen-go and protoc-gen-go-grpc at the versions that
# scripts/install_go_tools.sh pins and installs (into GOBIN, else GOPATH/bin);
# other versions are refused, since the committed stubs must be exactly what
# those make: the Go client test regenerates them and compares byte for byte.
# protoc's version goes into the stubs too; they are made with Debian 12's
# protoc (protobuf-compiler, 3.21.12).
# usage: client/go/generate.sh [OUT_DIR]
# env: PROTOC (default: protoc on PATH); GO (default: go on PATH), whose
#      GOBIN or GOPATH/bin holds the plugins.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$here}
go=${GO:-go}
protoc=${PROTOC:-protoc}
# shellcheck source=../../scripts/install_go_tools.sh
source "$root/scripts/install_go_tools.sh"

bin=$(GOTOOLCHAIN=local "$go" env GOBIN)
[[ -n "$bin" ]] || { bin=$(GOTOOLCHAIN=local "$go" env GOPATH); bin=${bin%%:*}/bin; }

# check_plugin NAME WANT: NAME --version must print WANT (with or without its v).
check_plugin() {
  local got
  if [[ ! -x "$bin/$1" ]]; then
    echo "generate.sh: $bin/$1: not found; install it with scripts/install_go_tools.sh" >&2
    exit 1
  fi
  got=$("$bin/$1" --version 2>&1 | awk '{print $NF}')
  if [[ "${got#v}" != "${2#v}" ]]; then
    echo "generate.sh: $bin/$1 is $got, expected $2 (scripts/install_go_tools.sh installs it)" >&2
    exit 1
  fi
}
check_plugin protoc-gen-go "$PROTOC_GEN_GO_VERSION"
check_plugin protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC_VERSION"

module=$(sed -n 's/^module \(.*\)$/\1/p' "$here/go.mod")
# The stubs' import path and package. relay.proto's own go_package stays as
# it is: it is part of the descriptor that the C++ and Python stubs embed,
# so changing it would change those too. M overrides it for this module.
pkg="$module/kvrelay/v1;kvrelayv1"
mkdir -p "$out"
out=$(cd "$out" && pwd)
# The proto's path is given relative to -I, so the stubs name it
# kvrelay/v1/relay.proto wherever the checkout is; module= places them by
# their import path inside this module (kvrelay/v1/).
cd "$root/proto"
"$protoc" -I . \
  "--plugin=protoc-gen-go=$bin/protoc-gen-go" \
  "--plugin=protoc-gen-go-grpc=$bin/protoc-gen-go-grpc" \
  "--go_out=$out" "--go_opt=module=$module,Mkvrelay/v1/relay.proto=$pkg" \
  "--go-grpc_out=$out" "--go-grpc_opt=module=$module,Mkvrelay/v1/relay.proto=$pkg" \
  kvrelay/v1/relay.proto
