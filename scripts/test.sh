#!/usr/bin/env bash
# The test command of the README: fetch the default model (cached, checked by
# sha256), run every test of the workspace, and close with one summary line
# over all test binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
# Deployment checks first (manifests, compose, alert rules, shellcheck): seconds, not minutes.
bash deploy/check.sh
BATON_MODEL="$(bash scripts/fetch-model.sh | tail -n 1)"
export BATON_MODEL
# NVRTC (from PyPI): kernels/tests/cuda_ptx.rs compiles every CUDA kernel to PTX
# with it, no GPU needed, so it must not skip here.
bash scripts/fetch-nvrtc.sh >/dev/null
export BATON_REQUIRE_NVRTC=1
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace --release --locked "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# The RDMA transport is an off-by-default feature: build and test it too. Without an RDMA
# device its device tests print "SKIPPED: no RDMA device (...)"; BATON_REQUIRE_RDMA=1 on a
# runner with one makes them fail instead.
if [ "$status" -eq 0 ]; then
    cargo test -p baton-kv-transport --release --locked --features rdma "$@" 2>&1 | tee -a "$log"
    status=${PIPESTATUS[0]}
fi
# The CUDA kernels compiled for the CPU (feature emu, kernels/emu) and checked against the
# CPU backend: their logic is tested here even without a GPU.
if [ "$status" -eq 0 ]; then
    cargo test -p baton-kernels --release --locked --features emu --test cuda_emulated "$@" 2>&1 | tee -a "$log"
    status=${PIPESTATUS[0]}
fi
# The Kubernetes node identities (wildcard certificates, tls-layout.sh) with the binary just built.
if [ "$status" -eq 0 ] && [ $# -eq 0 ]; then
    bash deploy/k8s/identity-test.sh "${CARGO_TARGET_DIR:-target}/release/baton" "$BATON_MODEL"
    status=$?
fi
set -e
passed=$(grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed' "$log" | grep -Eo '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed;' "$log" | awk '{s+=$1} END {print s+0}')
echo
echo "tests: ${passed} passed, ${failed} failed"
exit "$status"
