#!/usr/bin/env bash
# Fetch NVRTC (CUDA's run-time compiler) from the PyPI wheel nvidia-cuda-nvrtc-cu12
# into a cache folder and verify the wheel's sha256. The CUDA backend compiles its
# kernels with it; CI uses it to compile every kernels/cuda/*.cu file to PTX without
# a GPU. Idempotent. Prints the folder holding libnvrtc.so.12 on the last line.
set -euo pipefail

VERSION="12.8.93"
WHEEL="nvidia_cuda_nvrtc_cu12-${VERSION}-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl"
SHA256="a7756528852ef889772a84c6cd89d41dfa74667e24cca16bb31f8f061e3e9994"
CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/baton/nvrtc"
LIB_DIR="$CACHE_DIR/lib"
STAMP="$LIB_DIR/.from-$SHA256"

if [ -f "$STAMP" ] && [ -f "$LIB_DIR/libnvrtc.so.12" ]; then
    echo "$LIB_DIR"
    exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching nvidia-cuda-nvrtc-cu12==$VERSION from PyPI" >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check --only-binary=:all: \
    --platform manylinux2014_x86_64 "nvidia-cuda-nvrtc-cu12==$VERSION" -d "$tmp" >&2
if [ "$(sha256sum "$tmp/$WHEEL" | cut -d' ' -f1)" != "$SHA256" ]; then
    echo "error: sha256 of $WHEEL does not match $SHA256" >&2
    exit 1
fi
python3 - "$tmp/$WHEEL" "$tmp/lib" <<'PY'
import os, shutil, sys, zipfile
wheel, out = sys.argv[1:]
os.makedirs(out)
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("nvidia/cuda_nvrtc/lib/") and ".so" in name and ".alt." not in name:
            with z.open(name) as src, open(os.path.join(out, os.path.basename(name)), "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
PY
rm -rf "$LIB_DIR"
mkdir -p "$CACHE_DIR"
mv "$tmp/lib" "$LIB_DIR"
touch "$STAMP"
echo "$LIB_DIR"
