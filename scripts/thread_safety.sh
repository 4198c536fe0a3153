#!/usr/bin/env bash
# Compiles the relay (core, proto, the server library, the client library
# and kvrelayctl) with clang's thread-safety analysis as an error
# (-Wthread-safety -Werror=thread-safety, into build-tsa/): every member
# marked ABSL_GUARDED_BY is touched only under its mutex, and every function
# marked ABSL_EXCLUSIVE_LOCKS_REQUIRED is called with it held (core/mutex.h).
# -O0: the analysis runs in the front end; nothing here is run.
# Part of scripts/test.sh; KVRELAY_SKIP_THREAD_SAFETY=1 skips it there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${KVRELAY_TSA_DIR:-build-tsa}
JOBS=${KVRELAY_JOBS:-$(nproc)}
CXX=${KVRELAY_CLANG:-clang++}
start=$SECONDS
cmake -S . -B "$DIR" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_CXX_FLAGS_DEBUG="-O0" -DCMAKE_CXX_FLAGS="-Wthread-safety -Werror=thread-safety" \
  -DKVRELAY_BUILD_TESTS=OFF -DKVRELAY_BUILD_BENCHMARKS=OFF ${KVRELAY_CMAKE_ARGS:-} >/dev/null
cmake --build "$DIR" -j "$JOBS" --target kvrelay-server kvrelayctl
echo "thread-safety: clean in $((SECONDS - start)) s"
