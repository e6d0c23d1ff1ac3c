#!/usr/bin/env bash
# Offers the same multi-turn chat traffic (same seed, same model file, same machine) to
# `baton up` and to llama.cpp's llama-server, one after the other, and prints both
# tables; writes JSON and an SVG chart of latency percentiles over offered load.
#
#   bash scripts/bench-load-compare.sh [extra `baton bench load` flags]
#
# Needs a release build of baton (cargo build --release) and llama-server from
# scripts/llamacpp/build.sh. Output goes to target/bench-load/.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="$(bash scripts/fetch-model.sh | tail -n 1)"
BATON="${BATON_BIN:-target/release/baton}"
LLAMA_SERVER="${LLAMA_SERVER:-.cache/llamacpp/bin/llama-server}"
OUT=target/bench-load
mkdir -p "$OUT"
[ -x "$BATON" ] || { echo "error: $BATON missing; run cargo build --release" >&2; exit 1; }
[ -x "$LLAMA_SERVER" ] || { echo "error: $LLAMA_SERVER missing; run scripts/llamacpp/build.sh" >&2; exit 1; }

# The traffic: the seed's shape scaled to 2 cores (defaults of `baton bench load`
# otherwise). Override or add flags on the command line.
LOAD_FLAGS=(--levels "${LEVELS:-1,2,4,8}" --turns "${TURNS:-4}" --max-tokens 32 --think-time 1s --seed 11 "$@")
THREADS="${THREADS:-2}"
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

echo "== baton up"
db="$(mktemp -d)/bench.db"
KEY="bench-$(date +%s)-key"
BATON_API_KEY="$KEY" "$BATON" up --model "$MODEL" --threads "$THREADS" --db "$db" \
    --listen 127.0.0.1:18080 --coordinator-listen 127.0.0.1:0 --coordinator-http-listen 127.0.0.1:0 \
    --turns-per-minute 100000 --open-streams 256 --prompt-tokens-per-hour 1e12 --output-tokens-per-hour 1e12 \
    >"$OUT/baton-up.log" 2>&1 &
pids+=($!)
wait_http http://127.0.0.1:18080/healthz
"$BATON" bench load --url http://127.0.0.1:18080/v1 --api-key "$KEY" --label baton \
    --json "$OUT/baton.json" "${LOAD_FLAGS[@]}"
cleanup
pids=()

echo "== llama-server"
"$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port 18081 -t "$THREADS" -c 32768 -np 8 \
    >"$OUT/llama-server.log" 2>&1 &
pids+=($!)
wait_http http://127.0.0.1:18081/health
"$BATON" bench load --url http://127.0.0.1:18081/v1 --label llama-server \
    --json "$OUT/llama-server.json" --compare "$OUT/baton.json" --chart "$OUT/latency.svg" "${LOAD_FLAGS[@]}"
echo "wrote $OUT/baton.json $OUT/llama-server.json $OUT/latency.svg"
