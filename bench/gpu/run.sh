#!/usr/bin/env bash
# The GPU check, one script for a machine with an NVIDIA GPU (the `device` tool's
# H200, or any H100/H200 host): build the CUDA backend, run its conformance suite
# against the CPU backend, time the roofline benchmark, and write a results file
# (date, GPU, commit). Finishes inside 10 minutes.
#
#   BATON_COMMIT=$(git rev-parse HEAD) bash bench/gpu/run.sh
#
# Conformance thresholds (relative error, max |gpu - cpu| / max |cpu|; see
# kernels/tests/cuda_conformance.rs):
#   f32 element-wise ops                       1e-5
#   attention, KV in f32, f16, bf16 or e4m3    1e-5 (both backends write the same
#                                              KV bytes, checked bit for bit first)
#   matrix products (bf16 in, f32 accumulate)  1e-2
#   bf16 embedding rows                        4e-3
#   KV bytes written by both backends, and blocks moved through the staging
#   buffers in groups: identical; a row's result: the same bits
#   alone as in a batch (matrix products and attention), and a product's on
#   one stream as on several.
# The engine on CUDA (engine/tests/cuda_engine.rs, the first 4 layers of SmolLM2 and a
# 2-layer cut of Gemma 3 where the host has no model): logits Pearson >= 0.98 against the CPU backend per row, the
# same top token on >= 70% of rows, greedy tokens equal alone, chunked and batched.
# compute-sanitizer memcheck over the conformance suite where the tool exists.
# Targets (kernels/benches/gpu.rs): decode at batch 64 within 1.3x of the bandwidth
# roofline; prefill at >= 40% of the measured bf16 GEMM throughput.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
started=$(date +%s)
out_dir="${OUT:-bench/gpu/results}"
mkdir -p "$out_dir"
log="$out_dir/gpu-run.log"
: > "$log"
say() { echo "$@" | tee -a "$log"; }

gpu="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)"
say "GPU: ${gpu:-none found by nvidia-smi}"
say "commit: ${BATON_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
# NVRTC and cuBLAS of CUDA 13 or 12 (the backend binds either, up to the driver's
# major version): the toolkit, pip wheels, or BATON_CUDA_LIB_DIRS (searched first).
for base in libnvrtc libcublas libcublasLt; do
    where=""
    for major in 13 12; do
        lib="$base.so.$major"
        for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
            [ -z "$where" ] && [ -e "$dir/$lib" ] && where="$dir/$lib"
        done
        [ -z "$where" ] && where="$(ldconfig -p 2>/dev/null | grep -m1 " $lib " | awk '{print $NF}')"
        [ -z "$where" ] && where="$(find /usr /opt -name "$lib" 2>/dev/null | head -n 1)"
        [ -n "$where" ] && break
    done
    say "$base: ${where:-NOT FOUND}"
    if [ -n "$where" ]; then
        BATON_CUDA_LIB_DIRS="${BATON_CUDA_LIB_DIRS:+$BATON_CUDA_LIB_DIRS:}$(dirname "$where")"
    fi
done
export BATON_CUDA_LIB_DIRS="${BATON_CUDA_LIB_DIRS:-}"
export BATON_REQUIRE_GPU=1 BATON_REQUIRE_NVRTC=1

status=0
if command -v cargo >/dev/null; then
    say "== build (kernels crate, cuda feature)"
    timeout 240 cargo build --release --locked -p baton-kernels --features cuda --tests --benches 2>&1 | tail -n 3 | tee -a "$log"
    say "== conformance: CUDA backend vs CPU backend"
    timeout 120 cargo test --release --locked -p baton-kernels --features cuda --test cuda_conformance --test cuda_ptx -- --test-threads=1 2>&1 | tee -a "$log" | grep -E "^test |test result|panicked|SKIPPED|cuda \(" || true
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    say "== the engine on CUDA against the CPU (a real model)"
    timeout 120 cargo test --release --locked -p baton-engine --features cuda --test cuda_engine -- --test-threads=1 --nocapture 2>&1 | tee -a "$log" | grep -E "^test |test result|panicked|SKIPPED|KV:" || true
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    say "== roofline benchmark"
    timeout 300 cargo bench --locked -p baton-kernels --features cuda --bench gpu 2>&1 | tee -a "$log" | grep -vE "^\s+(Compiling|Finished|Running)" || status=1
else
    # No toolchain on the GPU host: binaries built elsewhere by `bash bench/gpu/prepare.sh`.
    say "== no cargo; running the prebuilt binaries in bench/gpu/prebuilt"
    timeout 90 bench/gpu/prebuilt/cuda_conformance --test-threads=1 2>&1 | tee -a "$log" || status=1
    # (the folder listing test reads the source tree at the path it was built in)
    timeout 60 bench/gpu/prebuilt/cuda_ptx --nocapture --skip every_cu_file_in_the_folder 2>&1 | tee -a "$log" || status=1
    say "== the engine on CUDA against the CPU (the first 4 layers of SmolLM2, 2 of Gemma 3)"
    BATON_MODEL="$PWD/bench/gpu/prebuilt/smollm2-4-layers.gguf" BATON_GEMMA_MODEL="$PWD/bench/gpu/prebuilt/gemma3-2-layers.gguf" \
        timeout 120 bench/gpu/prebuilt/cuda_engine --test-threads=1 --nocapture 2>&1 | tee -a "$log" || status=1
    if command -v compute-sanitizer >/dev/null; then
        say "== compute-sanitizer memcheck over the conformance suite"
        timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 bench/gpu/prebuilt/cuda_conformance --test-threads=1 2>&1 | tee -a "$log" | grep -E "^test |test result|ERROR SUMMARY|=========  *(Invalid|Out of)" | head -n 40 || true
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    fi
    say "== roofline benchmark"
    timeout 240 bench/gpu/prebuilt/gpu 2>&1 | tee -a "$log" || status=1
fi

elapsed=$(( $(date +%s) - started ))
results="$out_dir/$(date -u +%Y-%m-%d)-$(echo "${gpu%%,*}" | tr ' ' '-' | tr -cd 'A-Za-z0-9-').md"
{
    echo "# GPU run $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "- GPU: ${gpu:-unknown}"
    echo "- commit: ${BATON_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
    echo "- script: bench/gpu/run.sh, ${elapsed} s, exit status ${status}"
    echo
    echo '```'
    cat "$log"
    echo '```'
} > "$results"
say "results: $results (${elapsed} s)"
exit "$status"
