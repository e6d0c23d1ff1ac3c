#!/usr/bin/env bash
# The test command of the README: fetch the default model (cached, checked by
# sha256), then run every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
BATON_MODEL="$(bash scripts/fetch-model.sh | tail -n 1)"
export BATON_MODEL
cargo test --workspace --release --locked "$@"
