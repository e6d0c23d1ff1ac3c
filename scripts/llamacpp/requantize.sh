#!/usr/bin/env bash
# K-quant test models made from the default model (SmolLM2-135M-Instruct Q4_1) with
# llama.cpp's llama-quantize, so that the engine's golden tests and `baton bench engine`
# cover Q4_K and Q6_K weights on a model whose sizes are not multiples of 256 (llama.cpp
# falls back to Q5_0/Q8_0 for those tensors, as it does for any such model). No K-quant
# build of SmolLM2 is published in a package the scripts can fetch, hence this.
#
# Needs llama-quantize from scripts/llamacpp/build.sh. Idempotent: a file whose sha256
# is recorded beside it (FILE.sha256) and still matches is kept. The files stay in the
# model cache (never committed); the last lines printed are their paths.
#
# Usage: bash scripts/llamacpp/requantize.sh
# Env:   BATON_MODEL (the source; default: what scripts/fetch-model.sh prints),
#        BATON_MODEL_CACHE (as scripts/fetch-model.sh), LLAMA_QUANTIZE (the binary).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
QUANTIZE="${LLAMA_QUANTIZE:-$ROOT/.cache/llamacpp/bin/llama-quantize}"
SOURCE="${BATON_MODEL:-$(bash "$ROOT/scripts/fetch-model.sh" | tail -n 1)}"
CACHE_DIR="${BATON_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/baton/models}"

log() { echo "[llamacpp/requantize] $*" >&2; }

if [ ! -x "$QUANTIZE" ]; then
    echo "error: $QUANTIZE not found; run scripts/llamacpp/build.sh first" >&2
    exit 1
fi
mkdir -p "$CACHE_DIR"

for kind in Q4_K_M Q6_K; do
    target="$CACHE_DIR/SmolLM2-135M-Instruct.$kind.gguf"
    if [ -f "$target" ] && [ -f "$target.sha256" ] && (cd "$CACHE_DIR" && sha256sum --quiet -c "$target.sha256") >/dev/null 2>&1; then
        log "$target already made (sha256 $(cut -d' ' -f1 "$target.sha256"))"
    else
        log "making $target from $SOURCE"
        # --allow-requantize: the source is already quantized (Q4_1), so these files carry
        # its rounding too; they test the K-quant formats, not the best SmolLM2 quality.
        "$QUANTIZE" --allow-requantize "$SOURCE" "$target.tmp" "$kind" 2 >"$target.log" 2>&1 \
            || { tail -20 "$target.log" >&2; rm -f "$target.tmp"; exit 1; }
        mv "$target.tmp" "$target"
        (cd "$CACHE_DIR" && sha256sum "$(basename "$target")") >"$target.sha256"
        log "made $target (sha256 $(cut -d' ' -f1 "$target.sha256"); log $target.log)"
    fi
done
for kind in Q4_K_M Q6_K; do echo "$CACHE_DIR/SmolLM2-135M-Instruct.$kind.gguf"; done
