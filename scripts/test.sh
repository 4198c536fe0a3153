#!/usr/bin/env bash
# The test command: installs dependencies, builds, and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
BUILD_DIR=${KVRELAY_BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)"
# The core math again under AddressSanitizer + UndefinedBehaviorSanitizer.
if [ "${KVRELAY_SKIP_SANITIZERS:-0}" != 1 ]; then bash scripts/sanitize.sh; fi
# The store, the outbox, the spool, the stream codec, the pool and the pipeline under ThreadSanitizer.
if [ "${KVRELAY_SKIP_TSAN:-0}" != 1 ]; then bash scripts/tsan.sh; fi
# The relay under clang's thread-safety analysis (compile only).
if [ "${KVRELAY_SKIP_THREAD_SAFETY:-0}" != 1 ]; then bash scripts/thread_safety.sh; fi
# The decoders and parsers under libFuzzer (clang, ASan + UBSan), 30 s each.
if [ "${KVRELAY_SKIP_FUZZ:-0}" != 1 ]; then bash scripts/fuzz.sh 30; fi
