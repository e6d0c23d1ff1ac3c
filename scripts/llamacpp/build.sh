#!/usr/bin/env bash
# Build llama.cpp tooling (an independent reference implementation) for Baton,
# without committing any build output. Idempotent: re-running skips finished steps.
#
#   (a) venv at .cache/llamacpp/venv with llama-cpp-python compiled from the
#       PyPI sdist (CPU only), plus jinja2/numpy for scripts/llamacpp/golden.py
#   (b) llama-bench and llama-server built with cmake from the llama.cpp source
#       vendored in that same sdist, for this CPU (-march=native), installed to
#       .cache/llamacpp/bin/
#   (c) llama-quantize from the same source, built portable (baseline x86-64 code, no
#       fused multiply-adds) so that the K-quant test models it makes
#       (scripts/llamacpp/requantize.sh) are the same bytes on every machine, as the
#       goldens' recorded sha256 requires (the portable and the native build of
#       2026-12-03 made identical files on an AVX2 machine)
#
# Usage: bash scripts/llamacpp/build.sh
# Env:   LLAMACPP_PY_VERSION (default below), JOBS (default 2),
#        LLAMACPP_SKIP_SERVER=1 to build llama-bench (and llama-quantize) only,
#        LLAMACPP_ONLY=quantize to build llama-quantize alone (what the README's test
#        command needs; about 7 minutes on 2 cores).
set -euo pipefail

VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="$ROOT/.cache/llamacpp"
VENV="$CACHE/venv"
SRC="$CACHE/src"
BUILD="$CACHE/build"
BIN="$CACHE/bin"
mkdir -p "$CACHE" "$SRC" "$BIN"

log() { echo "[llamacpp/build] $*" >&2; }

# One set of ggml options for both builds. AMX is off: on machines whose CPU reports AMX
# (Sapphire Rapids and later) ggml 0.3.36's AMX matrix product crashes (SIGSEGV in
# ggml_backend_amx_mul_mat, seen in llama-bench on SmolLM2 Q4_1 and in the Python build
# on Gemma 3); without it ggml uses its AVX-512 VNNI kernels, the ISA Baton's CPU
# backend uses too, so the comparison stays like for like.
# GGML_AMX_*=OFF alone does not do it: with GGML_NATIVE=ON ggml compiles with
# -march=native and ignores those options, and -march=native defines __AMX_INT8__ on
# such a CPU, which is all ggml checks. So the compiler is told too (CFLAGS/CXXFLAGS,
# which cmake and the pip build both read; an explicit -mno-* wins over -march=native).
GGML_FLAGS="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF"
if [ "$(uname -m)" = x86_64 ]; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    export CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX"
fi
# Builds made with other options are rebuilt (the portable llama-quantize of (c) does not
# use these options and has its own stamp).
STAMP="$CACHE/ggml-flags"
STAMP_TEXT="$GGML_FLAGS CFLAGS=${CFLAGS:-} CXXFLAGS=${CXXFLAGS:-}"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$STAMP_TEXT" ]; then
    rm -rf "$BIN/llama-bench" "$BIN/llama-server" "$BUILD"
    mkdir -p "$BIN"
    REBUILD_PY=1
fi

# --- system tools -----------------------------------------------------------
need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v g++ >/dev/null 2>&1 || need+=(build-essential)
command -v git >/dev/null 2>&1 || need+=(git)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
if [ "${#need[@]}" -gt 0 ]; then
    log "installing with apt: ${need[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq >"$CACHE/apt.log" 2>&1
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >>"$CACHE/apt.log" 2>&1 \
        || { tail -20 "$CACHE/apt.log" >&2; exit 1; }
fi

# --- sdist ------------------------------------------------------------------
SDIST="$(ls "$SRC"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
if [ -z "$SDIST" ]; then
    log "downloading llama-cpp-python==$VERSION sdist"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$SRC"
    SDIST="$(ls "$SRC"/llama_cpp_python-"$VERSION".tar.gz)"
fi
# The source is compiled and run by the test command: it must be the reviewed release.
# Another version needs its own LLAMACPP_SDIST_SHA256.
PINNED_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
[ "$VERSION" = 0.3.36 ] || PINNED_SHA256=""
WANT_SHA256="${LLAMACPP_SDIST_SHA256:-$PINNED_SHA256}"
if [ -z "$WANT_SHA256" ]; then
    echo "error: no sha256 known for llama-cpp-python $VERSION; set LLAMACPP_SDIST_SHA256" >&2
    exit 1
fi
GOT_SHA256="$(sha256sum "$SDIST" | cut -d' ' -f1)"
if [ "$GOT_SHA256" != "$WANT_SHA256" ]; then
    echo "error: $SDIST has sha256 $GOT_SHA256, expected $WANT_SHA256; removed" >&2
    rm -f "$SDIST"
    rm -rf "$SRC/llama_cpp_python-$VERSION"
    exit 1
fi
UNPACKED="$SRC/llama_cpp_python-$VERSION"
if [ ! -f "$UNPACKED/vendor/llama.cpp/CMakeLists.txt" ]; then
    log "unpacking $SDIST"
    tar -xzf "$SDIST" -C "$SRC"
fi
LLAMA_SRC="$UNPACKED/vendor/llama.cpp"
LLAMA_COMMIT=unknown
[ -e "$LLAMA_SRC/.git" ] && LLAMA_COMMIT="$(git -C "$LLAMA_SRC" rev-parse HEAD 2>/dev/null || echo unknown)"

ONLY="${LLAMACPP_ONLY:-}"
case "$ONLY" in "" | quantize) ;; *) echo "error: LLAMACPP_ONLY must be empty or 'quantize', not '$ONLY'" >&2; exit 2 ;; esac

# --- (a) venv + llama-cpp-python --------------------------------------------
if [ -n "$ONLY" ]; then
    log "LLAMACPP_ONLY=$ONLY: no venv, llama-bench or llama-server"
else
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating venv $VENV"
        python3 -m venv "$VENV"
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
    fi
    have="$("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null || true)"
    if [ "$have" != "$VERSION" ] || [ "${REBUILD_PY:-0}" = 1 ]; then
        log "building llama-cpp-python $VERSION from sdist (CPU only, takes a while)"
        CMAKE_ARGS="$GGML_FLAGS" \
        CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        FORCE_CMAKE=1 \
            "$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir \
            --force-reinstall --verbose "$SDIST" > "$CACHE/pip-install.log" 2>&1 \
            || { tail -50 "$CACHE/pip-install.log" >&2; exit 1; }
    else
        log "llama-cpp-python $VERSION already installed"
    fi
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check jinja2 numpy
    # ggml reports what it was compiled with: AMX must not be in it (see GGML_FLAGS above).
    if "$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())' | grep -q "AMX_INT8 = 1"; then
        echo "error: llama-cpp-python was built with AMX (its matrix product crashes); CFLAGS did not reach the build" >&2
        exit 1
    fi
fi

# cmake_tools DIR LOG_SUFFIX SERVER FLAGS TARGET...: configure the llama.cpp source in DIR
# with FLAGS (LLAMA_BUILD_SERVER=SERVER), build the TARGETs and install them to $BIN; the
# logs are $CACHE/cmake-{configure,build}LOG_SUFFIX.log.
cmake_tools() {
    local dir="$1" suffix="$2" server="$3" flags="$4"
    shift 4
    log "configuring cmake build in $dir"
    # shellcheck disable=SC2086 # flags is a list of options
    cmake -S "$LLAMA_SRC" -B "$dir" -DCMAKE_BUILD_TYPE=Release $flags \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER="$server" -DBUILD_SHARED_LIBS=OFF \
        > "$CACHE/cmake-configure$suffix.log" 2>&1 \
        || { tail -50 "$CACHE/cmake-configure$suffix.log" >&2; exit 1; }
    log "building $* with -j$JOBS"
    cmake --build "$dir" --config Release -j"$JOBS" --target "$@" \
        > "$CACHE/cmake-build$suffix.log" 2>&1 \
        || { tail -50 "$CACHE/cmake-build$suffix.log" >&2; exit 1; }
    for t in "$@"; do
        install -m 0755 "$dir/bin/$t" "$BIN/$t"
    done
}

# --- (b) llama-bench / llama-server ------------------------------------------
targets=()
[ -n "$ONLY" ] || targets+=(llama-bench)
[ -n "$ONLY" ] || [ "${LLAMACPP_SKIP_SERVER:-0}" = "1" ] || targets+=(llama-server)
missing=0
for t in "${targets[@]}"; do [ -x "$BIN/$t" ] || missing=1; done
if [ "$missing" = 1 ]; then
    cmake_tools "$BUILD" "" ON "$GGML_FLAGS" "${targets[@]}"
elif [ "${#targets[@]}" -gt 0 ]; then
    log "binaries already in $BIN"
fi

echo "$STAMP_TEXT" >"$STAMP"

# --- (c) llama-quantize, portable --------------------------------------------
QBUILD="$CACHE/build-quantize"
QSTAMP="$CACHE/quantize-flags"
QFLAGS="-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF"
QSTAMP_TEXT="$QFLAGS CFLAGS=-ffp-contract=off"
if [ ! -x "$BIN/llama-quantize" ] || [ "$(cat "$QSTAMP" 2>/dev/null || true)" != "$QSTAMP_TEXT" ]; then
    rm -rf "$QBUILD" "$BIN/llama-quantize"
    CFLAGS="-ffp-contract=off" CXXFLAGS="-ffp-contract=off" cmake_tools "$QBUILD" -quantize OFF "$QFLAGS" llama-quantize
    echo "$QSTAMP_TEXT" >"$QSTAMP"
else
    log "llama-quantize (portable) already in $BIN"
fi
targets+=(llama-quantize)

# --- report -----------------------------------------------------------------
echo "llama-cpp-python $VERSION (sdist: $SDIST)"
echo "llama.cpp source:  $LLAMA_SRC (commit $LLAMA_COMMIT)"
[ -n "$ONLY" ] || echo "venv python:       $VENV/bin/python"
for t in "${targets[@]}"; do echo "$t: $BIN/$t"; done
echo "logs:              $CACHE/{pip-install,cmake-configure,cmake-build}{,-quantize}.log"
