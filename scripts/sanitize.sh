#!/usr/bin/env bash
# Builds the core library, kvrelayctl and core_test with AddressSanitizer and
# UndefinedBehaviorSanitizer (into build-asan/) and runs core_test and the
# float64 reference test against them: once with the AVX-512 kernels where the
# CPU has them, once with KVRELAY_DISABLE_AVX512=1 (the AVX2 kernels).
# Part of scripts/test.sh; KVRELAY_SKIP_SANITIZERS=1 skips it there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${KVRELAY_ASAN_DIR:-build-asan}
JOBS=${KVRELAY_JOBS:-$(nproc)}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S . -B "$DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVRELAY_BUILD_SERVICE=OFF -DKVRELAY_BUILD_BENCHMARKS=OFF \
  -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined"
cmake --build "$DIR" -j "$JOBS" --target core_test kvrelayctl
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
for disable in 0 1; do
  echo "sanitize: core_test and reference test, KVRELAY_DISABLE_AVX512=$disable"
  KVRELAY_DISABLE_AVX512=$disable "$DIR/bin/core_test" --gtest_brief=1
  KVRELAY_DISABLE_AVX512=$disable .venv/bin/python tests/reference/test_reference.py \
    --kvrelayctl "$DIR/bin/kvrelayctl"
done
echo "sanitize: clean"
