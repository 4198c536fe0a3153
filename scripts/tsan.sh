#!/usr/bin/env bash
# Builds core_test (the thread pool and the pipeline), proto_test (the stream
# codec) and store_tsan_test (the store's tests, and the store, the outbox,
# PendingCompression and the route file under concurrent callers) and
# spool_test (the spool: its journal thread, group commit, compaction and
# the crash loops) with
# ThreadSanitizer (gcc, -O1, into build-tsan/) and runs them. No
# suppressions: any report fails the stage.
# Debian's gRPC, protobuf, abseil and prometheus-cpp are not instrumented,
# so none of these tests starts a gRPC server or channel: TSan cannot see
# gRPC's threads and hand-offs, and the reactors are not covered here.
# Part of scripts/test.sh; KVRELAY_SKIP_TSAN=1 skips it there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${KVRELAY_TSAN_DIR:-build-tsan}
JOBS=${KVRELAY_JOBS:-$(nproc)}
# -O1 and line tables only (-g1): reports name file and line, and the build
# stays well below a RelWithDebInfo one.
SAN="-fsanitize=thread -fno-omit-frame-pointer -g1"
start=$SECONDS
cmake -S . -B "$DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" \
  -DKVRELAY_BUILD_BENCHMARKS=OFF -DCMAKE_CXX_FLAGS="$SAN" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" >/dev/null
cmake --build "$DIR" -j "$JOBS" --target core_test proto_test store_tsan_test spool_test
echo "tsan: built in $((SECONDS - start)) s"
# halt_on_error: the first report fails the run; exitcode 66 is TSan's own.
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
for t in core_test proto_test store_tsan_test spool_test; do
  echo "tsan: $t"
  "$DIR/bin/$t" --gtest_brief=1
done
echo "tsan: clean in $((SECONDS - start)) s"
