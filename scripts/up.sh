#!/usr/bin/env bash
# The README's start command: fetch the default model (cached, checked by sha256),
# build Baton, and start the whole cluster on this machine with `baton up`
# (coordinator, prefill node, decode node, gateway with the web chat page).
# Extra arguments go to `baton up` (see `baton up --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
BATON_MODEL="$(bash scripts/fetch-model.sh | tail -n 1)"
export BATON_MODEL
exec cargo run --release --locked --bin baton -- up "$@"
