#!/usr/bin/env bash
# A timed run of every fuzz target: SECONDS_EACH (default 60) seconds each, one
# after the other, starting from seeds/ and keeping what libFuzzer finds in corpus/
# (and crashes in artifacts/; both ignored by git). Exits non-zero on the first
# crash. Usage: fuzz/run.sh [target...]
set -euo pipefail
cd "$(dirname "$0")"
seconds="${SECONDS_EACH:-60}"
# cargo-fuzz passes nightly-only flags to rustc; this lets a stable toolchain take them.
export RUSTC_BOOTSTRAP=1
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo fuzz list)
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t"
    echo "== $t: ${seconds}s"
    nice cargo fuzz run "$t" "corpus/$t" "seeds/$t" -- -max_total_time="$seconds" -print_final_stats=1
done
