#!/usr/bin/env bash
# Times a newcomer's first start: a fresh `git clone` of a commit, an empty cargo cache
# (its own CARGO_HOME), then the README's start command `bash deploy/local/up.sh`, until
# the first streamed token of a chat answer arrives from the gateway (the API the web chat
# page uses). Prints the time to each step and the build alone on the last lines.
#
#   bash scripts/bench-first-start.sh [COMMIT]     # default: HEAD
#
# Run it for two commits, one after the other on the same machine, to compare them. The
# model cache is shared (the model fetch is not what this measures); the crates are not.
# Uses ports 8080, 7100-7101, 7201, 7301 on loopback; stops the cluster when done.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
commit="$(git -C "$repo" rev-parse "${1:-HEAD}")"
work="$(mktemp -d /tmp/baton-first-start.XXXXXX)"
pid=""
cleanup() {
    if [ -n "$pid" ]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

start=$(date +%s.%N)
since() { awk -v s="$start" -v n="$(date +%s.%N)" 'BEGIN { printf "%.0f", n - s }'; }
git clone -q --no-local "$repo" "$work/baton"
git -C "$work/baton" checkout -q "$commit"
# A fresh CARGO_HOME: no downloaded or unpacked crates (rustup's toolchains stay shared).
mkdir -p "$work/cargo-home"
export CARGO_HOME="$work/cargo-home"
export RUSTUP_HOME="${RUSTUP_HOME:-$HOME/.rustup}"
export PATH="$HOME/.cargo/bin:$PATH"
export BATON_API_KEY="sk-first-start-bench"
unset CARGO_TARGET_DIR

(cd "$work/baton" && exec bash deploy/local/up.sh) >"$work/up.log" 2>&1 &
pid=$!
built=""
while :; do
    if ! kill -0 "$pid" 2>/dev/null; then
        tail -n 30 "$work/up.log" >&2
        echo "bench-first-start: the start command stopped before answering" >&2
        exit 1
    fi
    if [ -z "$built" ] && grep -q "Finished \`" "$work/up.log"; then
        built=$(since)
        echo "bench-first-start: built after $built s" >&2
    fi
    if grep -q "Baton is up" "$work/up.log"; then
        break
    fi
    sleep 1
done
up=$(since)
echo "bench-first-start: up after $up s; asking for a chat answer" >&2
# The whole (short) stream into a file: a reader that stops at the first token would
# break the pipe and fail the script.
curl -sN --max-time 120 http://127.0.0.1:8080/v1/chat/completions \
    -H "Authorization: Bearer $BATON_API_KEY" -H 'Content-Type: application/json' \
    -d '{"model":"baton","stream":true,"max_tokens":8,"messages":[{"role":"user","content":"Hello!"}]}' >"$work/answer.txt" || true
answered=$(since)
if ! grep -q '"content"' "$work/answer.txt"; then
    cat "$work/answer.txt" >&2
    echo "bench-first-start: no streamed token in the answer" >&2
    exit 1
fi
echo "commit              ${commit:0:12}"
echo "clone to built      ${built:-?} s"
echo "clone to 'up'       $up s"
echo "clone to answer     $answered s"
