#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets) for SECONDS each (default 60) from its seeds, and
# prints one line per target: executions, corpus size and crashes found. A crash's input lands
# in fuzz/artifacts/<target>/; once fixed, copy it to fuzz/regressions/<target>/ so that the
# normal test run replays it.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# cargo-fuzz needs a nightly compiler's flags (sanitizers, coverage instrumentation); the
# stable toolchain grants them with RUSTC_BOOTSTRAP=1. Targets run one after another (AddressSanitizer,
# 2 GiB RSS limit, 10 s per input).
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_EACH="${1:-60}"
shift || true
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
export RUSTC_BOOTSTRAP=1

if [ $# -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(ls fuzz/fuzz_targets | sed 's/\.rs$//')
fi

cargo run --release --locked -q -p dc-fuzz --example write_seeds -- fuzz/corpus
(cd fuzz && cargo fuzz build)

failed=0
for t in "${targets[@]}"; do
    log="fuzz/artifacts/$t.log"
    mkdir -p "fuzz/artifacts/$t"
    set +e
    (cd fuzz && cargo fuzz run "$t" "corpus/$t" -- -max_total_time="$SECONDS_EACH" \
        -rss_limit_mb=2048 -timeout=10 -print_final_stats=1) >"$log" 2>&1
    rc=$?
    set -e
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    crashes=$(find "fuzz/artifacts/$t" -type f \( -name 'crash-*' -o -name 'oom-*' -o -name 'timeout-*' -o -name 'leak-*' \) | wc -l)
    corpus=$(find "fuzz/corpus/$t" -type f | wc -l)
    printf '%-20s %12s executions  %6s in corpus  %3s findings  (exit %s)\n' "$t" "${runs:-?}" "$corpus" "$crashes" "$rc"
    if [ "$rc" != 0 ] || [ "$crashes" != 0 ]; then
        failed=1
        grep -m3 -E 'panicked|ERROR: |SUMMARY' "$log" | sed 's/^/    /' || true
    fi
done
exit "$failed"
