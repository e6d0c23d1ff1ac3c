#!/usr/bin/env bash
# Builds the GPU check's binaries on this machine (no GPU needed) into
# bench/gpu/prebuilt, for a GPU host without a Rust toolchain, and cuts the first
# 2 layers of the default model and 2 of Gemma 3 270M for the engine's end-to-end
# checks (the whole models are over the device tool's 64 MiB). Carry that folder
# with the working tree and run bench/gpu/run.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=bench/gpu/prebuilt
mkdir -p "$out"

# copy_artifacts JSON NAME...: copies each named test or bench executable from cargo's JSON.
copy_artifacts() {
    local json="$1"
    shift
    for name in "$@"; do
        exe="$(echo "$json" | python3 -c "
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get('reason') == 'compiler-artifact' and m['target']['name'] == '$name' and m.get('executable'):
        print(m['executable'])" | tail -n 1)"
        cp "$exe" "$out/$name"
        echo "$out/$name"
    done
}

# Only the targets the check runs (every test of the engine crate would take many minutes more).
copy_artifacts "$(cargo build --release --locked -p baton-kernels --features cuda --test cuda_conformance --test cuda_ptx --bench gpu --message-format=json 2>/dev/null)" cuda_conformance cuda_ptx gpu
copy_artifacts "$(cargo build --release --locked -p baton-engine --features cuda --test cuda_engine --message-format=json 2>/dev/null)" cuda_engine

# `baton bench cluster --backend cuda` (#38): the one binary with its default features
# (CUDA among them), stripped and xz-compressed (about 37 -> 9 MiB) to fit what the device
# tool carries; run.sh unpacks it.
copy_artifacts "$(cargo build --release --locked -p baton --bin baton --message-format=json 2>/dev/null)" baton
strip --strip-all "$out/baton"
xz -6 -T2 -f "$out/baton"

model="$(bash scripts/fetch-model.sh | tail -n 1)"
# SmolLM2's 49,152-token embedding is most of a 2-layer slice (35 MiB): its first 8,192
# tokens, with the BPE merges among them, keep the tokenizer and chat template whole in 9 MiB.
cargo run --release --locked -q -p baton-engine --example gguf_first_layers -- "$model" "$out/smollm2-2-layers.gguf" 2 --vocab 8192
# Gemma 3 270M's embedding alone is over the limit: 2 layers, the first 8,192 tokens,
# and a 24-token window with every second layer global, so that the parity test
# (cuda_engine's gemma3_forward_pass_matches_the_cpu) covers a local and a global
# layer and a prompt past the window in 13 MiB.
gemma="$(bash scripts/fetch-model.sh gemma3 | tail -n 1)"
cargo run --release --locked -q -p baton-engine --example gguf_first_layers -- "$gemma" "$out/gemma3-2-layers.gguf" 2 \
    --vocab 8192 --sliding-window 24 --sliding-window-pattern 2
# Fully stripped, the test binaries lose their symbol tables (panics still name the test).
strip --strip-all "$out"/cuda_conformance "$out"/cuda_ptx "$out"/gpu "$out"/cuda_engine 2>/dev/null || true
# What the device tool carries: the tracked tree and this folder, 64 MiB in all.
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
out_bytes=$(du -cb "$out"/* | tail -n 1 | cut -f1)
total=$((tree_bytes + out_bytes))
echo "carried: $((total / 1048576)) MiB (tree $((tree_bytes / 1048576)) MiB, $out $((out_bytes / 1048576)) MiB)"
if [ "$total" -gt $((64 << 20)) ]; then
    echo "error: the GPU check's tree and $out come to over 64 MiB, more than the device tool carries" >&2
    exit 1
fi
