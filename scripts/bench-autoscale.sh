#!/usr/bin/env bash
# The planner in the loop on this machine: the same multi-turn ramp (2 -> 24 -> 2 open
# conversations, same seed) offered to `baton up` with a fixed pool (the baseline) and then
# to `baton up --autoscale`, one after the other; prints both load tables side by side and
# what the planner did (decisions by reason, nodes started and drained, conversations
# moved, the largest pool).
#
#   bash scripts/bench-autoscale.sh [extra `baton bench load` flags]
#
# Needs a release build of baton (cargo build --release). Output goes to
# target/bench-autoscale/. On 2 cores more nodes add no capacity: this shows the loop and
# its safety (no failed turn while nodes come and go); `baton simulate --day` the savings.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="$(bash scripts/fetch-model.sh | tail -n 1)"
BATON="${BATON_BIN:-target/release/baton}"
OUT=target/bench-autoscale
mkdir -p "$OUT"
[ -x "$BATON" ] || { echo "error: $BATON missing; run cargo build --release" >&2; exit 1; }

LOAD_FLAGS=(--levels "${LEVELS:-2,6,12,24,12,6,2}" --turns "${TURNS:-4}" --max-tokens 32 --think-time 1s --seed 11 --conversation-header "$@")
AUTOSCALE_FLAGS=(--autoscale --max-nodes "${MAX_NODES:-4}" --autoscale-interval 2s --autoscale-batch "${BATCH:-4}" --autoscale-scale-down-delay 20s)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_http() { # url
    for _ in $(seq 1 240); do
        curl -sf -o /dev/null "$1" && return 0
        sleep 0.5
    done
    echo "error: $1 did not come up" >&2
    return 1
}

run() { # label, extra baton up flags...
    local label="$1"
    shift
    echo "== baton up ($label)"
    local db
    db="$(mktemp -d)/bench.db"
    KEY="bench-$(date +%s)-key"
    BATON_API_KEY="$KEY" BATON_KV_STAGING_MIB=64 "$BATON" up --model "$MODEL" --threads 2 --db "$db" \
        --listen 127.0.0.1:18090 --coordinator-listen 127.0.0.1:0 --coordinator-http-listen 127.0.0.1:0 \
        --decode-http-listen 127.0.0.1:0 --prefill-http-listen 127.0.0.1:0 --kv-memory-mib 256 --kv-tier2-mib 0 \
        --turns-per-minute 100000 --open-streams 256 --prompt-tokens-per-hour 1e12 --output-tokens-per-hour 1e12 \
        "$@" >"$OUT/$label-up.log" 2>&1 &
    pids+=($!)
    wait_http http://127.0.0.1:18090/healthz
    local compare=()
    [ "$label" = autoscale ] && compare=(--compare "$OUT/fixed.json")
    "$BATON" bench load --url http://127.0.0.1:18090/v1 --api-key "$KEY" --label "$label" \
        --json "$OUT/$label.json" "${compare[@]}" "${LOAD_FLAGS[@]}"
    # The ramp is over: give the planner its scale-down delay and a few intervals.
    [ "$label" = autoscale ] && sleep 40
    cleanup
    pids=()
}

run fixed
run autoscale "${AUTOSCALE_FLAGS[@]}"

log="$OUT/autoscale-up.log"
echo
echo "== what the planner did (${AUTOSCALE_FLAGS[*]})"
echo "decisions: $(grep -c '^autoscale t=' "$log")"
echo "reasons:   $(grep -o '^  [a-z]* \[[a-z_]*\]' "$log" | sort | uniq -c | awk '{printf "%s %s %s; ", $2, $3, $1}')"
echo "started:   $(grep -c '^autoscale: started' "$log")  drained: $(grep -c '^autoscale: drained' "$log")  died: $(grep -c 'exited on its own' "$log")"
echo "largest decode pool: $(grep -o '^autoscale t=[0-9]*s: decode [0-9]* -> [0-9]*' "$log" | awk '{print $NF}' | sort -n | tail -1)"
awk '/^autoscale: drained/ {m += $6; f += $8} END {printf "conversations moved by drains: %d, failed: %d\n", m, f}' "$log"
grep -E '^autoscale: (started|drained)|^autoscale t=.*decode ([0-9]+) -> ([0-9]+)' "$log" | awk '
    /^autoscale t=/ { split($0, a, "decode "); split(a[2], b, " "); sub(",", "", b[3]); if (b[1] != b[3]) print } /^autoscale: / { print }'
echo "logs: $OUT/fixed-up.log $OUT/autoscale-up.log; JSON: $OUT/fixed.json $OUT/autoscale.json"
