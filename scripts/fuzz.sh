#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer into build-fuzz/, then runs each for SECONDS
# (default 30) from its seed corpus fuzz/corpus/<target>/, one at a time.
# Prints per target the executions reached and whether it crashed, and the
# total; exits 1 when any target crashed (the input is in
# build-fuzz/artifacts/, the log in build-fuzz/logs/).
# Part of scripts/test.sh with 30 s; KVRELAY_SKIP_FUZZ=1 skips it there.
# usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-30}
shift || true
DIR=${KVRELAY_FUZZ_DIR:-build-fuzz}
JOBS=${KVRELAY_JOBS:-$(nproc)}
CXX=${KVRELAY_FUZZ_CXX:-clang++-14}
ALL=(safetensors turn_file message_file raw_chunk stream_codec wire_codec policy_spec pipeline server_config route_file
  tokens_file spool_journal spool_message_file)
TARGETS=("$@")
((${#TARGETS[@]})) || TARGETS=("${ALL[@]}")
launcher=()
command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$CXX" \
  -DKVRELAY_BUILD_FUZZERS=ON -DKVRELAY_BUILD_TESTS=OFF -DKVRELAY_BUILD_BENCHMARKS=OFF "${launcher[@]}" >/dev/null
# The corpus writer is built too, so that it keeps compiling; run it by hand
# (docs/TESTING.md) when a format changes.
cmake --build "$DIR" -j "$JOBS" --target "${TARGETS[@]/#/fuzz_}" fuzz_make_corpus

export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
mkdir -p "$DIR/logs" "$DIR/artifacts"
total=0
crashed=()
printf 'fuzz: %s s per target\n' "$SECS"
for t in "${TARGETS[@]}"; do
  # New inputs go to the build's own corpus; the committed seeds stay as they are.
  mkdir -p "$DIR/corpus/$t"
  log="$DIR/logs/$t.log"
  rc=0
  "$DIR/bin/fuzz_$t" "$DIR/corpus/$t" "fuzz/corpus/$t" -max_total_time="$SECS" -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$DIR/artifacts/$t-" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  if [[ -z "$execs" ]]; then
    execs=$(grep -o '^#[0-9]*' "$log" | tail -n 1 | tr -d '#')
  fi
  execs=${execs:-0}
  total=$((total + execs))
  if ((rc != 0)); then
    crashed+=("$t")
    printf 'fuzz: %-18s %12s executions  CRASHED (rc %d, see %s)\n' "$t" "$execs" "$rc" "$log"
    grep -m 3 -E 'ERROR:|FUZZ_CHECK|runtime error|Test unit written' "$log" | sed 's/^/fuzz:   /' || true
  else
    printf 'fuzz: %-18s %12s executions  0 crashes\n' "$t" "$execs"
  fi
done
printf 'fuzz: total %s executions over %d targets, %d crashed\n' "$total" "${#TARGETS[@]}" "${#crashed[@]}"
((${#crashed[@]} == 0))
