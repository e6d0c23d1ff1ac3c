#!/usr/bin/env bash
# Builds the GPU check's binaries on this machine (no GPU needed) into
# bench/gpu/prebuilt, for a GPU host without a Rust toolchain; carry that folder
# with the working tree and run bench/gpu/run.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p bench/gpu/prebuilt
json="$(cargo build --release --locked -p baton-kernels --features cuda --tests --benches --message-format=json 2>/dev/null)"
for name in cuda_conformance cuda_ptx gpu; do
    exe="$(echo "$json" | python3 -c "
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get('reason') == 'compiler-artifact' and m['target']['name'] == '$name' and m.get('executable'):
        print(m['executable'])" | tail -n 1)"
    cp "$exe" "bench/gpu/prebuilt/$name"
    echo "bench/gpu/prebuilt/$name"
done
