#!/usr/bin/env bash
# The same benchmarks and the same greedy replies from two builds, in one run: REV's
# release binary (built in a worktree under target/before-after/, reusing this tree's
# release dependencies) beside this tree's. For a refactoring that must change nothing.
#
#   bash scripts/bench-before-after.sh REV            # e.g. 3ad61ac (before issue #20)
#   ROUNDS=3 CLUSTER_FLAGS="--cold-tokens 3000" bash scripts/bench-before-after.sh REV
#
# Prints, for each of ROUNDS alternating rounds (before, after, before, after, ...), the
# summary lines of `baton bench engine` and `baton bench cluster`, then whether
# `baton generate` gave byte-identical greedy replies to each of a few prompts. Exits 1
# if any reply differs. Output: target/before-after/.
set -euo pipefail
cd "$(dirname "$0")/.."
REV="${1:?usage: bench-before-after.sh REV}"
ROUNDS="${ROUNDS:-2}"
# A shorter cold turn than the command's default, so that a round takes minutes.
read -r -a cluster_flags <<<"${CLUSTER_FLAGS:---cold-tokens 1024 --warm-tokens 128 --repeats 2}"
MODEL="$(bash scripts/fetch-model.sh | tail -n 1)"
OUT=target/before-after
mkdir -p "$OUT"
sha="$(git rev-parse --short "$REV")"
tree="$OUT/tree-$sha"
if [ ! -d "$tree" ]; then
    git worktree add --detach "$tree" "$sha" >/dev/null
fi
# Third-party crates are the same in both builds: start from this tree's release output.
if [ ! -d "$tree/target/release" ] && [ -d target/release ]; then
    mkdir -p "$tree/target" && cp -r target/release "$tree/target/release"
fi
echo "building $sha (before) and this tree (after), release" >&2
(cd "$tree" && cargo build --release -q -p baton)
cargo build --release -q -p baton
BEFORE="$tree/target/release/baton"
AFTER=target/release/baton

bench() { # label binary
    local label="$1" bin="$2"
    "$bin" bench engine --model "$MODEL" >"$OUT/$label-engine.txt" 2>&1
    "$bin" bench cluster --model "$MODEL" "${cluster_flags[@]}" >"$OUT/$label-cluster.txt" 2>&1
    echo "== $label: bench engine"
    grep -E "baton|prefill|decode|tok/s" "$OUT/$label-engine.txt" | grep -v "^\s*$" | head -n 12
    echo "== $label: bench cluster"
    grep -E "ttft|TTFT|cold|warm" "$OUT/$label-cluster.txt" | head -n 12
}
for r in $(seq 1 "$ROUNDS"); do
    bench "before-$r" "$BEFORE"
    bench "after-$r" "$AFTER"
done

prompts=("The capital of France is" "Write a haiku about rivers." "def fibonacci(n):" "List three primary colours and explain why.")
differ=0
for i in "${!prompts[@]}"; do
    p="${prompts[$i]}"
    "$BEFORE" generate --model "$MODEL" --user "$p" --max-tokens 64 >"$OUT/before-gen-$i.txt" 2>/dev/null
    "$AFTER" generate --model "$MODEL" --user "$p" --max-tokens 64 >"$OUT/after-gen-$i.txt" 2>/dev/null
    if cmp -s "$OUT/before-gen-$i.txt" "$OUT/after-gen-$i.txt"; then
        echo "same reply ($(wc -c <"$OUT/after-gen-$i.txt") bytes): $p"
    else
        echo "DIFFERENT reply: $p"
        differ=1
    fi
done
exit "$differ"
