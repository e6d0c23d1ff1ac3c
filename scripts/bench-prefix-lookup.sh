#!/usr/bin/env bash
# Prefix-cache lookup cost before and after a change, side by side: builds the lookup
# bench (engine/benches/prefix_lookup) in this tree and in an export of BASE, where the
# cache matched by hash alone, and runs both on this machine one after the other.
#
#   bash scripts/bench-prefix-lookup.sh [BASE]     # default: 488b076, before token comparison
#
# The base tree shares this tree's target directory, so only its kernels and engine
# crates are built again. BASE's cache API takes hashes, so the bench's api.rs is swapped for the
# hash-only calls below; the harness (main.rs) is the same file in both builds.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
base="$(git -C "$repo" rev-parse "${1:-488b076}")"
# The base tree is kept between runs (same path, same files), so a rerun rebuilds nothing.
work="${TMPDIR:-/tmp}/baton-bench-lookup-${base:0:12}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"

# Cargo names a workspace member's artifacts by its path inside the workspace, so the
# base engine lives in `engine-base`: at `engine` it would overwrite this tree's engine
# in the shared target directory.
if [ ! -f "$work/.exported" ]; then
    rm -rf "$work"
    mkdir -p "$work"
    git -C "$repo" archive "$base" | tar -x -C "$work"
    mv "$work/engine" "$work/engine-base"
    sed -i 's|^    "engine",|    "engine-base",|; s|path = "engine" }|path = "engine-base" }|' "$work/Cargo.toml"
    grep -q '"engine-base"' "$work/Cargo.toml" || { echo "cannot move the base engine" >&2; exit 1; }
    mkdir -p "$work/engine-base/benches/prefix_lookup"
    sed -n '/^\[\[bench\]\]/,$p' "$repo/engine/Cargo.toml" >> "$work/engine-base/Cargo.toml"
    touch "$work/.exported"
fi
# Copies only what changed, so that cargo sees unchanged files as unchanged.
put() { cmp -s "$1" "$2" || cp "$1" "$2"; }
put "$repo/engine/benches/prefix_lookup/main.rs" "$work/engine-base/benches/prefix_lookup/main.rs"
api="$(mktemp)"
trap 'rm -f "$api"' EXIT
cat > "$api" <<'RS'
//! The cache calls of the lookup bench against an engine that matched by hash alone.

use baton_engine::kv::{BlockId, BlockStore, HashChain, KvCache, UserId};

pub const VARIANT: &str = "hash only, tokens not compared";

pub fn publish(cache: &mut KvCache, chain: &HashChain, _prompt: &[u32], store: &mut dyn BlockStore) -> Vec<BlockId> {
    let ids = cache.allocate(chain.hashes().len(), store).expect("allocate");
    let owner = baton_engine::kv::BlockOwner::User { user: UserId::new("bench-user-0042"), conversation: None };
    for (&b, &h) in ids.iter().zip(chain.hashes()) {
        cache.register(b, h, &owner).expect("register");
    }
    ids
}

pub fn match_all(cache: &mut KvCache, chain: &HashChain, _prompt: &[u32], store: &mut dyn BlockStore) -> Vec<BlockId> {
    cache.match_prefix(chain.hashes(), store).blocks
}

pub fn peek_all(cache: &KvCache, chain: &HashChain, _prompt: &[u32]) -> usize {
    cache.peek_prefix(chain.hashes()).primary
}
RS
put "$api" "$work/engine-base/benches/prefix_lookup/api.rs"

echo "== before: $(git -C "$repo" log -1 --format='%h %s' "$base" | cut -c1-70)"
(cd "$work" && cargo bench -q -p baton-engine --bench prefix_lookup)
echo "== after: this tree ($(git -C "$repo" log -1 --format=%h HEAD)$(git -C "$repo" diff --quiet || echo ', with changes'))"
(cd "$repo" && cargo bench -q -p baton-engine --bench prefix_lookup)
