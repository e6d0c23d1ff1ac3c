#!/usr/bin/env bash
# Builds the GPU check's binaries on this machine (no GPU needed) into
# bench/gpu/prebuilt, for a GPU host without a Rust toolchain, and cuts the first
# 4 layers of the default model for the engine's end-to-end check (the whole model
# is over the device tool's 64 MiB). Carry that folder with the working tree and
# run bench/gpu/run.sh there. The folder and the tracked tree come to about 61 MiB.
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

model="$(bash scripts/fetch-model.sh | tail -n 1)"
cargo run --release --locked -q -p baton-engine --example gguf_first_layers -- "$model" "$out/smollm2-4-layers.gguf" 4
du -sh "$out"
