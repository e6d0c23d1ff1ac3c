#!/usr/bin/env bash
# `baton bench engine` on the two builds of the same source, alternately in one run: the
# release profile (cargo build --release, what the benchmarks and CI use) and profile `up`
# (what the start command builds: deploy/local/up.sh). Checks that the quick-to-build
# profile did not slow the engine.
#
#   bash scripts/bench-profiles.sh [ROUNDS]      # default 3 rounds of both
#
# Builds both binaries first if they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
target="${CARGO_TARGET_DIR:-target}"
[ -x "$target/release/baton" ] || cargo build --release --locked --bin baton
[ -x "$target/up/baton" ] || cargo build --profile up --locked --bin baton --no-default-features
MODEL="$(bash scripts/fetch-model.sh | tail -n 1)"

# row LABEL BINARY: one bench run, as "LABEL pp512 tg128-b1 tg128-b32".
row() {
    local out
    out="$("$2" bench engine --model "$MODEL" --no-llama --batches 1,32 --reps 3 2>&1)"
    printf '%-8s %10s %10s %10s\n' "$1" \
        "$(awk '/^prefill tok\/s/ {print $4}' <<<"$out")" \
        "$(awk '/^decode tok\/s batch 1 / {print $6}' <<<"$out")" \
        "$(awk '/^decode tok\/s batch 32 / {print $6}' <<<"$out")"
}

printf '%-8s %10s %10s %10s\n' profile "pp512" "tg128 b1" "tg128 b32"
for _ in $(seq "$rounds"); do
    row release "$target/release/baton"
    row up "$target/up/baton"
done
