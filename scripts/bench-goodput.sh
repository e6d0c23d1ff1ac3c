#!/usr/bin/env bash
# Goodput under the seed's SLO on `baton up`, with issue #24's load shape: multi-turn chat,
# a ~300-token system prompt shared by all (294 words of the generator's vocabulary, about
# one token each, plus the opening sentence), ~40-token messages, replies capped at 64
# tokens, 4 turns per conversation, 2 s mean think time, greedy. A turn is inside the SLO
# when its first token came within 1 s and its own p95 inter-token gap is within 50 ms.
#
#   bash scripts/bench-goodput.sh                        # this build; 24, 48, 96 conversations
#   LEVELS=24 BASELINE_BIN=/work/main/target/release/baton bash scripts/bench-goodput.sh
#
# With BASELINE_BIN the same traffic (same seed) goes first to `baton up` of that binary
# (e.g. main's build), then to this build's, one after the other. Then the same traffic
# goes to llama.cpp's llama-server on the same model file and both cores, once with 4
# slots (-np 4) and once with 24 (-np 24); the issue compares against the better of the
# two per level. NO_LLAMA=1 skips it; llama-server is built by scripts/llamacpp/build.sh
# when missing. The load generator is always this build's, so only the server differs.
# Arguments go to `baton up` of both Baton runs (e.g. --threads 2); NEW_FLAGS only to this
# build's (e.g. "--decode-threads 2"). The last table prints every run, then a summary of
# the share of turns inside the SLO per level. Output: target/bench-goodput/.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="$(bash scripts/fetch-model.sh | tail -n 1)"
BATON="${BATON_BIN:-target/release/baton}"
OUT=target/bench-goodput
mkdir -p "$OUT"
[ -x "$BATON" ] || { echo "error: $BATON missing; run cargo build --release" >&2; exit 1; }
[ -z "${BASELINE_BIN:-}" ] || [ -x "$BASELINE_BIN" ] || { echo "error: BASELINE_BIN=$BASELINE_BIN is not executable" >&2; exit 1; }

LOAD_FLAGS=(--levels "${LEVELS:-24,48,96}" --turns 4 --system-words 294 --message-words 40
    --long-doc-probability 0 --max-tokens 64 --think-time 2s --temperature 0 --seed 24
    --ttft-target 1s --itl-target 50ms --conversation-header)
read -r -a new_flags <<<"${NEW_FLAGS:-}"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_http() { # url
    for _ in $(seq 1 480); do
        curl -sf -o /dev/null "$1" && return 0
        sleep 0.5
    done
    echo "error: $1 did not come up" >&2
    return 1
}

# measure LABEL URL [API key]: the whole load against one server, compared with the
# runs before it.
measure() {
    local label="$1" url="$2" key="${3:-}"
    local compare=()
    for j in "${done_json[@]}"; do compare+=(--compare "$j"); done
    local auth=()
    [ -z "$key" ] || auth=(--api-key "$key")
    "$BATON" bench load --url "$url" "${auth[@]}" --label "$label" \
        --json "$OUT/$label.json" "${compare[@]}" "${LOAD_FLAGS[@]}"
    done_json+=("$OUT/$label.json")
}

# run LABEL BINARY [extra `baton up` flags...]: one `baton up`, the whole load, stopped.
run() {
    local label="$1" bin="$2"
    shift 2
    echo "== $label ($bin)"
    local db
    db="$(mktemp -d)/bench.db"
    local key
    key="bench-$(date +%s)-key"
    BATON_API_KEY="$key" "$bin" up --model "$MODEL" --db "$db" \
        --listen 127.0.0.1:18090 --coordinator-listen 127.0.0.1:0 --coordinator-http-listen 127.0.0.1:0 \
        --decode-http-listen 127.0.0.1:0 --prefill-http-listen 127.0.0.1:0 \
        --turns-per-minute 100000 --open-streams 1024 --prompt-tokens-per-hour 1e12 --output-tokens-per-hour 1e12 \
        "$@" >"$OUT/$label-up.log" 2>&1 &
    pids+=($!)
    wait_http http://127.0.0.1:18090/healthz
    grep -m1 "engines" "$OUT/$label-up.log" || true
    measure "$label" http://127.0.0.1:18090/v1 "$key"
    cleanup
    pids=()
}

# run_llama SLOTS: llama-server with that many parallel slots over a 32K context (1,365
# tokens a slot at 24, more than a 4-turn conversation of this load needs).
run_llama() {
    local slots="$1" label="llama-server-np$1"
    echo "== $label ($LLAMA_SERVER)"
    "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port 18091 -t "$(nproc)" -c 32768 -np "$slots" \
        >"$OUT/$label.log" 2>&1 &
    pids+=($!)
    wait_http http://127.0.0.1:18091/health
    measure "$label" http://127.0.0.1:18091/v1
    cleanup
    pids=()
}

done_json=()
if [ -n "${BASELINE_BIN:-}" ]; then
    run baseline "$BASELINE_BIN" "$@"
fi
run baton "$BATON" "$@" "${new_flags[@]}"
if [ "${NO_LLAMA:-0}" != 1 ]; then
    LLAMA_SERVER="${LLAMA_SERVER:-.cache/llamacpp/bin/llama-server}"
    [ -x "$LLAMA_SERVER" ] || bash scripts/llamacpp/build.sh >&2
    run_llama 4
    run_llama 24
fi
echo
echo "== share of turns inside the SLO (TTFT <= 1 s, the turn's own p95 ITL <= 50 ms)"
python3 - "${done_json[@]}" <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[1:]]
levels = sorted({l["conversations"] for r in runs for l in r["levels"]})
print("conv  " + "  ".join(f"{r['label']:>22}" for r in runs))
for n in levels:
    cells = []
    for r in runs:
        l = next((l for l in r["levels"] if l["conversations"] == n), None)
        cells.append("-" if l is None else f"{100 * l['goodput_share']:.0f}% {l['turns_per_second']:.2f}/s")
    print(f"{n:>4}  " + "  ".join(f"{c:>22}" for c in cells))
PY
echo "wrote ${done_json[*]}"
