#!/usr/bin/env bash
# CI smoke run of every fuzz target: ~30 s each (FUZZ_SECONDS to change).
# Installs cargo-fuzz when missing. libFuzzer needs nightly-only rustc
# flags; RUSTC_BOOTSTRAP=1 lets the stable toolchain take them.
#
# A finding fails the run; the crashing input is left under
# fuzz/artifacts/<target>/ (gitignored). Minimize it with
#   RUSTC_BOOTSTRAP=1 cargo fuzz tmin <target> <input>
# then commit it under tests/fuzz_regressions/<target>/, where
# tests/it/fuzz_regressions.rs replays it on every `cargo test`.
set -euo pipefail
cd "$(dirname "$0")"
export RUSTC_BOOTSTRAP=1
seconds="${FUZZ_SECONDS:-30}"
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
for target in ops codec scrub; do
    echo "== fuzz $target for ${seconds}s"
    mkdir -p "corpus/$target"
    log="$(mktemp)"
    status=0
    # An op sequence needs room from the start: no slow growth of the
    # input length for the differential target.
    extra=()
    if [ "$target" = ops ]; then extra=(-len_control=0 -max_len=384); fi
    cargo fuzz run "$target" "corpus/$target" -- -max_total_time="$seconds" -print_final_stats=1 "${extra[@]}" >"$log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        tail -n 60 "$log" >&2
        echo "fuzz target $target failed (exit $status); see fuzz/artifacts/$target/" >&2
        exit "$status"
    fi
    grep -E '^(#[0-9]+ +DONE|Done |stat::number_of_executed_units|stat::peak_rss_mb)' "$log" || tail -n 5 "$log"
    rm -f "$log"
done
