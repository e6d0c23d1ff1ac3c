#!/usr/bin/env bash
# The README's start command: fetch the default model (cached, checked by sha256),
# build Baton, and start the whole cluster on this machine with `baton up`
# (coordinator, prefill node, decode node, gateway with the web chat page).
# Extra arguments go to `baton up` (see `baton up --help`); CARGO_TARGET_DIR is honoured.
#
#   bash deploy/local/up.sh                       # chat page http://127.0.0.1:8080/
#   BATON_API_KEY=sk-local bash deploy/local/up.sh   # choose the API key
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$SECONDS

# Building and running need only a C toolchain, pkg-config and python3 with pip.
bash scripts/setup.sh run
echo "baton: fetching the default model (cached after the first run)" >&2
BATON_MODEL="$(bash scripts/fetch-model.sh | tail -n 1)"
export BATON_MODEL
echo "baton: model $BATON_MODEL" >&2
# Only what `baton up` runs: no etcd membership; the CUDA backend only where an NVIDIA
# driver is installed. Profile `up` (Cargo.toml): the engine at full optimization, the
# rest compiled quickly.
features=()
if [ -e /dev/nvidiactl ] || command -v nvidia-smi >/dev/null 2>&1; then
    features=(--features cuda)
fi
echo "baton: building (cargo build --profile up; target dir ${CARGO_TARGET_DIR:-target}; about 5 minutes on 2 cores the first time)" >&2
cargo build --profile up --locked --bin baton --no-default-features "${features[@]}"
echo "baton: built in $((SECONDS - start)) s since the start command began" >&2
bin="${CARGO_TARGET_DIR:-target}/up/baton"
echo "baton: starting the cluster; when it is up it prints the chat page, API, API key and" >&2
echo "       each node's metrics URL (the gateway's: http://${BATON_GATEWAY_LISTEN:-127.0.0.1:8080}/metrics)." >&2
echo "       Ctrl-C (or SIGTERM to PID $$) stops every role cleanly." >&2
exec "$bin" up "$@"
