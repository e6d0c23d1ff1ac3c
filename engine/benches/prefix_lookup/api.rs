//! The cache calls of the lookup bench, for the current engine: keys carry
//! each block's scope and tokens, and every hit compares them.

use baton_engine::kv::{BlockId, BlockStore, HashChain, KvCache, OwnerId};

pub const VARIANT: &str = "hash + scope + tokens + parent link compared";

/// Allocates and publishes every full block of `prompt` as one chain.
pub fn publish(cache: &mut KvCache, chain: &HashChain, prompt: &[u32], store: &mut dyn BlockStore) -> Vec<BlockId> {
    let keys = chain.keys(prompt, usize::MAX);
    let ids = cache.allocate(keys.len(), store).expect("allocate");
    let owner = baton_engine::kv::BlockOwner::User { owner: OwnerId::parse("bench-user-0042").expect("a valid owner"), conversation: None };
    let mut parent = None;
    for (&b, key) in ids.iter().zip(keys) {
        parent = cache.register(b, key, parent, &owner).expect("register").link();
    }
    ids
}

/// Matches (pins) the whole prompt; the caller releases.
pub fn match_all(cache: &mut KvCache, chain: &HashChain, prompt: &[u32], store: &mut dyn BlockStore) -> Vec<BlockId> {
    cache.match_prefix(&chain.keys(prompt, usize::MAX), store).blocks
}

/// Blocks a peek finds.
pub fn peek_all(cache: &KvCache, chain: &HashChain, prompt: &[u32]) -> usize {
    cache.peek_prefix(&chain.keys(prompt, usize::MAX)).primary
}
