#!/usr/bin/env bash
# The GPU check of issue #37, one script for a machine with an NVIDIA GPU (the `device`
# tool's H200, or any H100/H200 host), in under 5 minutes: the CUDA backend's conformance
# suite against the CPU backend, the PTX checks, the engine on CUDA against the CPU (a
# real model's first layers), compute-sanitizer memcheck, the roofline bench with the
# analytic model beside it, and PyTorch on the same shapes in the same run where it is
# installed (bench/gpu/torch_reference.py), side by side with Baton and the issue's
# targets judged (bench/gpu/side_by_side.py); and for issue #38, `baton bench cluster
# --backend cuda` (the cluster's overhead over one engine, local and remote prefill). Writes one results file,
# ${OUT:-bench/gpu/results}/<date>-<gpu>.md (date, GPU, commit, every step's output);
# commit it.
#
#   bash bench/gpu/prepare.sh                           # here, no GPU: binaries + model slice
#   BATON_COMMIT=$(git rev-parse HEAD) bash bench/gpu/run.sh   # there
#
# It runs the binaries in bench/gpu/prebuilt (the GPU host may have no Rust toolchain);
# where they are missing and cargo is there, it runs prepare.sh first (outside the 5
# minutes). The SASS checks (kernels/tests/cuda_sass.rs) need no GPU and run in CI.
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
#   one stream as on several; the fused operations (fused.cu): the bits of the
#   unfused sequences they replace.
# The engine on CUDA (engine/tests/cuda_engine.rs, the first 2 layers of SmolLM2 and a
# 2-layer cut of Gemma 3): logits Pearson >= 0.98 against the CPU backend per row, the
# same top token on >= 70% of rows, greedy tokens equal alone, chunked and batched.
# Targets (#37; printed met / NOT met at the end): decode at batch 64 within 1.3x of the
# bandwidth roofline and no slower than PyTorch with CUDA graphs, at batch 1 within 2x;
# decode attention reading KV at >= 70% of the copy bandwidth at batch 64 and 256; prefill
# at >= 40% of the measured bf16 GEMM throughput.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
prebuilt=bench/gpu/prebuilt
need=(cuda_conformance cuda_ptx cuda_engine gpu baton.xz smollm2-2-layers.gguf gemma3-2-layers.gguf)
for f in "${need[@]}"; do
    if [ ! -e "$prebuilt/$f" ]; then
        if command -v cargo >/dev/null; then
            echo "$prebuilt/$f missing: building with bench/gpu/prepare.sh first"
            bash bench/gpu/prepare.sh || exit 1
            break
        fi
        echo "error: $prebuilt/$f missing and no cargo here: run bash bench/gpu/prepare.sh on a machine with Rust and carry $prebuilt" >&2
        exit 1
    fi
done

started=$(date +%s)
budget=290 # seconds for every step together: the check stays under 5 minutes
out_dir="${OUT:-bench/gpu/results}"
mkdir -p "$out_dir"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
log="$work/run.log"
: >"$log"
say() { echo "$@" | tee -a "$log"; }
summary=()
status=0

# step NAME CAP CMD...: run CMD for at most CAP seconds (less if the budget is nearly
# spent), its output to the terminal, the log and $work/NAME.out; record how it ended.
step() {
    local name="$1" cap="$2"
    shift 2
    local left=$((budget - ($(date +%s) - started)))
    [ "$cap" -gt "$left" ] && cap=$left
    say "== $name"
    if [ "$cap" -lt 5 ]; then
        say "not run: the ${budget} s budget is spent"
        summary+=("$name: NOT RUN (out of time)")
        status=1
        return
    fi
    local t0 rc took
    t0=$(date +%s)
    timeout "$cap" "$@" 2>&1 | tee "$work/$name.out" | tee -a "$log"
    rc=${PIPESTATUS[0]}
    took=$(($(date +%s) - t0))
    if [ "$rc" -eq 0 ] && grep -q "SKIPPED" "$work/$name.out"; then
        summary+=("$name: FAILED, it SKIPPED (${took} s)")
        status=1
    elif [ "$rc" -eq 0 ]; then
        summary+=("$name: ok (${took} s)")
    else
        [ "$rc" -eq 124 ] && say "timed out after ${cap} s"
        summary+=("$name: FAILED, exit $rc (${took} s)")
        status=1
    fi
}

gpu="$(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | head -n 1)"
say "GPU: ${gpu:-none found by nvidia-smi}"
commit="${BATON_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
say "commit: $commit"
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

# --nocapture: the frame-checksum timing (GPU vs host) goes to the log.
step conformance 60 "$prebuilt/cuda_conformance" --test-threads=1 --nocapture
# (the folder listing test reads the source tree at the path it was built in)
step ptx 30 "$prebuilt/cuda_ptx" --nocapture --skip every_cu_file_in_the_folder
BATON_MODEL="$PWD/$prebuilt/smollm2-2-layers.gguf" BATON_GEMMA_MODEL="$PWD/$prebuilt/gemma3-2-layers.gguf" \
    step engine 90 "$prebuilt/cuda_engine" --test-threads=1 --nocapture
step roofline 120 "$prebuilt/gpu"
if python3 -c "import torch" 2>/dev/null; then
    step torch 120 python3 bench/gpu/torch_reference.py
else
    say "== torch: PyTorch not installed, not run"
    : >"$work/torch.out"
    summary+=("torch: NOT RUN (no PyTorch)")
fi
# The cluster's overhead over one engine (#38): coordinator, decode and prefill nodes in one
# process over gRPC and QUIC on loopback, on the 2-layer SmolLM2 slice, local and remote
# prefill (KV shipped after the prefill, then pipelined layer by layer); it judges the
# targets itself (lines "target: ...").
baton_bin="$work/baton"
if { xz -dc "$prebuilt/baton.xz" 2>/dev/null || python3 -c 'import lzma, sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' "$prebuilt/baton.xz"; } >"$baton_bin"; then
    chmod +x "$baton_bin"
    step cluster 60 "$baton_bin" bench cluster --backend cuda --model "$PWD/$prebuilt/smollm2-2-layers.gguf" \
        --cold-tokens 2048 --warm-tokens 128 --repeats 3
else
    say "== cluster: could not unpack $prebuilt/baton.xz"
    summary+=("cluster: FAILED (baton.xz not unpacked)")
    status=1
fi
# Last, with what is left of the budget: instrumenting every kernel (cuBLAS's too) makes
# it the slowest step, and the others' numbers should not wait on it.
if command -v compute-sanitizer >/dev/null; then
    step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$prebuilt/cuda_conformance" --test-threads=1
else
    say "== memcheck: compute-sanitizer not on PATH, not run"
    summary+=("memcheck: NOT RUN (no compute-sanitizer)")
fi
say "== side by side"
python3 bench/gpu/side_by_side.py "$work/roofline.out" "$work/torch.out" 2>&1 | tee "$work/side.md" | tee -a "$log"

elapsed=$(($(date +%s) - started))
name="$(echo "${gpu%%,*}" | tr ' ' '-' | tr -cd 'A-Za-z0-9-')"
results="$out_dir/$(date -u +%Y-%m-%d)-${name:-no-GPU}.md"
{
    echo "# GPU run $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "- GPU: ${gpu:-unknown}"
    echo "- commit: $commit"
    echo "- script: bench/gpu/run.sh, ${elapsed} s, exit status ${status}"
    for s in "${summary[@]}"; do echo "- $s"; done
    echo
    cat "$work/side.md"
    echo
    if [ -s "$work/cluster.out" ]; then
        echo "Cluster overhead (#38, \`baton bench cluster --backend cuda\`, 2-layer SmolLM2 slice):"
        echo
        sed -n '/^mode /,$p' "$work/cluster.out" | sed 's/^/    /'
        echo
    fi
    echo '```'
    cat "$log"
    echo '```'
} >"$results"
say "results: $results (${elapsed} s)"
exit "$status"
