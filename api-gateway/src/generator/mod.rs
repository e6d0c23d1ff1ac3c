//! The seam between the gateway and whatever produces tokens: one in-process
//! engine (`baton::local_generator::LocalGenerator`, in the root crate) or the cluster (coordinator plus decode
//! nodes, added beside this module). The gateway only ever holds an
//! `Arc<dyn Generator>`, so it runs the same in front of either.
//!
//! Invariants every implementation keeps: dropping a [`GenerationStream`]
//! cancels the sequence within a step; a stream ends with exactly one
//! `Finished` or `Failed` event; `evict_conversation` says which nodes
//! acknowledged and which may still hold the conversation's KV (an eviction
//! with none owed left no block of it anywhere).

pub mod cluster;
pub mod fallback;

use baton_text::sampling::SamplingParams;
use baton_vocab::{ConversationId, OwnerId};
use baton_text::{FinishReason, TokenOut, Usage};
use std::pin::Pin;
use std::time::Duration;

/// What the gateway needs from whatever produces tokens: one in-process engine, or the cluster.
#[async_trait::async_trait]
pub trait Generator: Send + Sync + 'static {
    /// Starts one generation. Dropping the returned stream cancels it.
    async fn generate(&self, req: GenerateRequest) -> Result<GenerationStream, GenerateError>;
    /// Removes every KV block of the conversation wherever it is cached; answers which
    /// nodes acknowledged and which still owe it (unreachable, or away from the cluster).
    async fn evict_conversation(&self, conversation: &ConversationId) -> Result<Eviction, GenerateError>;
    /// Why the generator serves in a degraded way right now (for `/healthz`), if it does.
    fn degraded(&self) -> Option<String> {
        None
    }
}

/// What one eviction attempt achieved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Eviction {
    /// Nodes that acknowledged (their KV of the conversation is gone).
    pub acked: Vec<String>,
    /// Nodes that may still hold it: failed to answer, or not asked (away).
    pub owed: Vec<String>,
}

impl Eviction {
    /// No node may hold the conversation's KV any more.
    pub fn complete(&self) -> bool {
        self.owed.is_empty()
    }
}

/// One generation: the full prompt as token IDs (the gateway tokenizes) and
/// who it runs for.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    /// The authenticated user; the owner scope of every KV block the prompt
    /// publishes except the platform-shared prefix.
    pub owner: OwnerId,
    /// Leading prompt tokens supplied by the platform (the system prompt).
    pub platform_prefix_len: usize,
    /// The ring key (the wire's `routing_key`): the conversation ID, or for a plain
    /// OpenAI request a hash of the owner, system prompt and first user message.
    /// Also tags the blocks the request publishes so that deleting the conversation
    /// evicts them.
    pub conversation: ConversationId,
    pub sampling: SamplingParams,
}

/// Events of one generation, ending with `Finished` or `Failed`.
pub type GenerationStream = Pin<Box<dyn futures::Stream<Item = GenEvent> + Send>>;

#[derive(Debug)]
pub enum GenEvent {
    Token(TokenOut),
    Finished { reason: FinishReason, usage: Usage, trailing_text: String },
    Failed(GenerateError),
}

/// Why a generation could not start or did not finish.
#[derive(thiserror::Error, Debug, Clone)]
pub enum GenerateError {
    /// No engine or decode node can take the request now (HTTP 503).
    #[error("the model service is unavailable: {0}")]
    Unavailable(String),
    /// Queues are full; try again after `retry_after` (HTTP 429).
    #[error("the model service is overloaded; retry after {retry_after:?}")]
    Overloaded { retry_after: Duration },
    /// The request itself is wrong (HTTP 400); the message is safe to show.
    #[error("{0}")]
    BadRequest(String),
    /// Prompt plus max_tokens do not fit the context (HTTP 400).
    #[error("prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the context of {max_context} tokens")]
    ContextTooLong { prompt: usize, max_tokens: usize, max_context: usize },
    /// Anything else (HTTP 500); the message is logged, never shown.
    #[error("internal error: {0}")]
    Internal(String),
}

impl GenerateError {
    /// Stable label for logs and the stored finish reason of a failed turn.
    pub fn label(&self) -> &'static str {
        match self {
            GenerateError::Unavailable(_) => "unavailable",
            GenerateError::Overloaded { .. } => "overloaded",
            GenerateError::BadRequest(_) => "bad_request",
            GenerateError::ContextTooLong { .. } => "context_too_long",
            GenerateError::Internal(_) => "internal",
        }
    }
}
