//! Identifier newtypes of the KV layer and the owner scope of a block.
//!
//! Every ID is a distinct type so that a block index can never be passed where a
//! hash is expected, nor an owner ID where a conversation ID is (Dynamo does the same
//! for its block hashes). The string IDs ([`OwnerId`], [`ConversationId`]) are the
//! shared ones of `baton-vocab`, checked where they enter; the gateway takes the owner
//! from the API key or session, never from a request body.

use std::fmt;

pub use baton_vocab::{ConversationId, OwnerId};

/// Index of a block in the primary (device) KV pool, `0..num_blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The index as a `usize`, for slicing per-block tables.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block {}", self.0)
    }
}

/// The chain hash of a full block: the hash of its parent block's hash, its owner
/// scope and its token IDs (see [`super::block_hash`]). Where the prefix cache looks
/// for a block, on any node; a cached block is reused only if its scope, tokens and
/// parent link also equal the asker's ([`super::BlockKey`]), since hashes can collide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockHash(pub u64);

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A running sequence inside one engine (one turn being prefilled or decoded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(pub u64);

/// Who may reuse a block: everyone (a platform-supplied prefix such as the system
/// prompt) or only the user whose tokens produced it. The scope is hashed into the
/// block's chain hash, so users' blocks normally land apart, and stored with every
/// cached block and compared on every lookup, so a collision cannot cross owners.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum OwnerScope {
    /// Shared by every user: the block lies entirely inside the platform prefix.
    Platform,
    /// Private to one user.
    User(OwnerId),
}

/// Who published a block into the prefix index, so that deleting a conversation or
/// a user removes exactly their blocks. Passed to [`super::KvCache::register`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockOwner {
    /// A platform-scope block (system prompt): survives conversation and user
    /// deletion, since it holds no user data.
    Platform,
    /// A user-scope block, tagged with the conversation it came from when there is
    /// one (a plain OpenAI request may have none: it is then deleted only with the
    /// user).
    User {
        /// The owner of the block's data.
        owner: OwnerId,
        /// The conversation that produced it.
        conversation: Option<ConversationId>,
    },
}

impl BlockOwner {
    /// A user block of a conversation.
    pub fn conversation(owner: OwnerId, conversation: ConversationId) -> Self {
        Self::User {
            owner,
            conversation: Some(conversation),
        }
    }
}
