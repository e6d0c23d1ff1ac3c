#!/usr/bin/env bash
# The test command of the README: install what the tests need (scripts/setup.sh test:
# only what is missing), fetch the default model (cached, checked by sha256), run every
# test of the workspace, and close with one summary line over all test binaries, however
# the run ends. A step that fails without a failing test (a build error, a check script,
# a fetch) counts as one failure and is named above the summary line.
set -euo pipefail
cd "$(dirname "$0")/.."

log="$(mktemp)"
step_log="$(mktemp)"
status=0
failed_steps=()
current="set-up"
summary() {
    local rc=$?
    if [ "$status" -eq 0 ] && [ "$rc" -ne 0 ]; then
        status=$rc
        failed_steps+=("$current (exit $rc)")
    fi
    local passed failed
    passed=$(grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed' "$log" | grep -Eo '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')
    failed=$(grep -Eo '[0-9]+ failed;' "$log" | awk '{s+=$1} END {print s+0}')
    failed=$((failed + ${#failed_steps[@]}))
    echo
    for s in "${failed_steps[@]}"; do echo "failed without a failing test: $s"; done
    echo "tests: ${passed} passed, ${failed} failed"
    rm -f "$log" "$step_log"
    exit "$status"
}
trap summary EXIT

# step NAME CMD...: run CMD unless an earlier step failed; its output goes to the log.
step() {
    local name="$1"
    shift
    [ "$status" -eq 0 ] || return 0
    current="$name"
    set +e
    "$@" 2>&1 | tee "$step_log"
    local rc=${PIPESTATUS[0]}
    set -e
    cat "$step_log" >>"$log"
    if [ "$rc" -ne 0 ]; then
        status=$rc
        # Failing tests are counted from cargo's own lines; a step that failed without
        # one (the build, a script) is one failure of its own.
        if ! grep -Eq '[1-9][0-9]* failed;' "$step_log"; then
            failed_steps+=("$name (exit $rc)")
        fi
    fi
}

current="scripts/setup.sh test"
bash scripts/setup.sh test
# Installed by setup.sh, so the browser test must run rather than skip.
export BATON_REQUIRE_BROWSER=1
echo "disk before the build: $(df -h --output=avail . | tail -n 1 | tr -d ' ') free"

# Deployment checks first (manifests, compose, alert rules, shellcheck): seconds, not minutes.
step "deploy/check.sh" bash deploy/check.sh
current="scripts/fetch-model.sh"
BATON_MODEL="$(bash scripts/fetch-model.sh | tail -n 1)"
export BATON_MODEL
# The second model (Gemma 3 270M, SentencePiece, sliding window): named explicitly so its
# tests (engine/tests/gemma3.rs, tokenizer_corpus.rs) run rather than skip.
BATON_GEMMA_MODEL="$(bash scripts/fetch-model.sh gemma3 | tail -n 1)"
export BATON_GEMMA_MODEL
# The SmolLM2 Q4_K_M / Q6_K goldens (engine/tests/golden_llamacpp.rs) run on files made by
# llama.cpp's llama-quantize from the default model (scripts/llamacpp/requantize.sh). Only
# that tool is built, portable so the files are the same bytes on every machine (about 7
# minutes on 2 cores, once: the build is cached in .cache/llamacpp); the files are named
# explicitly so those tests run rather than skip.
current="scripts/llamacpp/build.sh (llama-quantize)"
LLAMACPP_ONLY=quantize bash scripts/llamacpp/build.sh >/dev/null
current="scripts/llamacpp/requantize.sh"
requantized="$(bash scripts/llamacpp/requantize.sh | tail -n 2)"
BATON_SMOLLM2_Q4_K_M_MODEL="$(sed -n 1p <<<"$requantized")"
BATON_SMOLLM2_Q6_K_MODEL="$(sed -n 2p <<<"$requantized")"
export BATON_SMOLLM2_Q4_K_M_MODEL BATON_SMOLLM2_Q6_K_MODEL
# NVRTC (from PyPI): kernels/tests/cuda_ptx.rs compiles every CUDA kernel to PTX
# with it, no GPU needed, so it must not skip here.
current="scripts/fetch-nvrtc.sh"
bash scripts/fetch-nvrtc.sh >/dev/null
export BATON_REQUIRE_NVRTC=1
# ptxas, cuobjdump and nvdisasm (from PyPI): kernels/tests/cuda_sass.rs assembles every
# kernel to SASS for sm_90 and sm_80 and checks spills, tensor-core instructions and
# occupancy, no GPU needed, so it must not skip here either.
current="scripts/fetch-cuda-tools.sh"
bash scripts/fetch-cuda-tools.sh >/dev/null
export BATON_REQUIRE_SASS=1
# The attention kernels exist on the tensor cores (attn_mma_*): a build without them fails.
export BATON_EXPECT_MMA=1
step "cargo test --workspace" cargo test --workspace --release --locked "$@"
# The RDMA transport is an off-by-default feature: build and test it too. Without an RDMA
# device its device tests print "SKIPPED: no RDMA device (...)"; BATON_REQUIRE_RDMA=1 on a
# runner with one makes them fail instead.
step "cargo test --features rdma" cargo test -p baton-kv-transport --release --locked --features rdma "$@"
# The CUDA kernels compiled for the CPU (feature emu, kernels/emu) and checked against the
# CPU backend: their logic is tested here even without a GPU.
step "cargo test --features emu" cargo test -p baton-kernels --release --locked --features emu --test cuda_emulated "$@"
# And a whole forward pass of SmolLM2 and Gemma 3 with those kernels (EmuBackend) against the CPU backend.
step "cargo test --features emu (engine)" cargo test -p baton-engine --release --locked --features emu --test cuda_emulated_engine --test decode_steps_emulated "$@"
# The Kubernetes node identities (wildcard certificates, tls-layout.sh) with the binary just built.
if [ $# -eq 0 ]; then
    step "deploy/k8s/identity-test.sh" bash deploy/k8s/identity-test.sh "${CARGO_TARGET_DIR:-target}/release/baton" "$BATON_MODEL"
fi
# Lints: clippy over every crate and target, warnings as errors (where a lint is wrong for
# a piece of code, that code allows it and says why), and over the code behind the
# features the default build leaves out (the RDMA transport, the emulated CUDA kernels;
# the CUDA backend is in the default build). Skipped, and said so, where the toolchain
# has no clippy and scripts/setup.sh could not add it.
if [ $# -eq 0 ]; then
    if cargo clippy --version >/dev/null 2>&1; then
        step "cargo clippy" cargo clippy --workspace --all-targets --release --locked -- -D warnings
        step "cargo clippy --features rdma" cargo clippy -p baton-kv-transport --features rdma --all-targets --release --locked -- -D warnings
        step "cargo clippy --features emu" cargo clippy -p baton-kernels -p baton-engine --features emu --all-targets --release --locked -- -D warnings
    else
        echo "cargo clippy: not part of this Rust toolchain (rustup component add clippy); lints skipped"
    fi
fi
